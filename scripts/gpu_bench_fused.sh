#!/usr/bin/env bash
# GPU batch for the MoE layer without copies (issue 35; benchmarks/fused.md). One GPU (an H100), from the repo
# root, wheels in .whl/ (scripts/peers_wheels.sh), about 8 minutes:
#
#   git archive 81c77ae xmoe_jax scripts configs | (mkdir -p .old && tar -x -C .old)   # the code before, here
#   bash scripts/gpu_bench_fused.sh                                                    # carry .whl and .old
#
# Steps: scripts/bench_gather_gmm.py (the row-indexed grouped GEMMs against permute + gmm + ungroup, the
# Small expert shapes, with a dense ceiling and torch._grouped_mm); the train step of the Small shapes x 4
# layers at batch 32 (configs/tiny_small_shape.yaml, 15 steps) with the code before issue 35 (.old/, if
# present) and with this tree, then torchtitan's best one-GPU row (no checkpointing, batch 16) through
# scripts/bench_peers.sh, so the ratios come from one call.
# CPU dry run (tests/test_gpu_batches.py; the torchtitan row fails there): DRY_RUN=1 GATHER_ARGS=--tiny
#   bash scripts/gpu_bench_fused.sh, and with PART=depth DEPTH_TRANSPORT=bucketed.
#
# PART=depth (4 GPUs, about 8 minutes): the paper's Small at 28 layers, EP 4, 4 x 16k tokens per GPU,
# save_exchange, force-balanced router, $DEPTH_STEPS (25) steps with command buffers off so every kernel keeps
# its name, a trace of steps 18-19 read by scripts/step_breakdown.py (shares, and device copies by source) and
# scripts/kernel_overlap.py: the code before (.old/, bucketed) and this tree ($DEPTH_TRANSPORT, push).
#
# PART=ab (one GPU, about 5 minutes): an environment switch against the default on the one-GPU train step
# (configs/tiny_small_shape.yaml, $AB_STEPS (20) steps, last window): AB_ENV="VAR=value ...; VAR=value ..."
# (variants switch1, switch2, ... split at ';'; default XMOE_GMM_GATHER=xla, benchmarks/train_step.md), all
# alternating twice in one call, then one traced run of each (steps 16-17, command buffers off, read by
# scripts/step_breakdown.py; AB_TRACE=0 skips them). Every JSON, log and report in $OUT/ab.tgz.
set -u
source "$(dirname "$0")/gpu_env.sh"
STEPS=${STEPS:-15}
depth() {  # name dir transport: a traced full-depth run from the tree in dir
  local name=$1 dir=$2 transport=$3
  rm -rf "/tmp/$name"  # a warm machine keeps the last call's run directory, which the trainer never writes over
  (cd "$dir" && step "$name" 330 env PYTHONPATH="/tmp/site:$PWD" \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" python3 scripts/bench_train_step.py --config configs/small.yaml --steps "${DEPTH_STEPS:-25}" --log-every 5 \
    --out "$OUT/$name.json" --run-dir "/tmp/$name" --set mesh.expert=4 --set mesh.data=1 --set train.batch_size=128 \
    --set train.micro_batch_size=32 --set model.remat=save_exchange --set parallel.transport="$transport" \
    --set model.moe.force_balance=true --set train.tensorboard=false --set "train.profile_steps=[18,19]" \
    ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} ${SHAPES:-})
  read_trace "/tmp/$name/profile" "$OUT/$name"
}
env_record "$OUT/env.txt"
if [ "${PART:-one}" = depth ]; then
  [ -d .old ] && depth depth_before .old bucketed
  depth depth_after . "${DEPTH_TRANSPORT:-push}"
  cat "$OUT/steps.txt"; python3 scripts/gpu_summary.py "$OUT" 2>&1 | tail -4
  for f in "$OUT"/*.breakdown.md; do echo "== $f"; head -40 "$f"; done
  exit 0
fi
if [ "${PART:-one}" = ab ]; then
  IFS=';' read -ra variants <<< "${AB_ENV:-XMOE_GMM_GATHER=xla}"
  ab_step() {  # name env... : the one-GPU train step with env (none: the default) exported
    local name=$1; shift
    ([ $# -eq 0 ] || export "$@"; train_step "$name" 180 "${AB_STEPS:-20}" configs/tiny_small_shape.yaml --set train.tensorboard=false \
      ${AB_RUN_ARGS:-})
  }
  for round in a b; do
    ab_step "default_$round"
    for i in "${!variants[@]}"; do
      # shellcheck disable=SC2086  # a variant is a list of assignments
      ab_step "switch$((i + 1))_$round" ${variants[$i]}
    done
  done
  if [ "${AB_TRACE:-1}" = 1 ]; then
    for i in $(seq 0 "${#variants[@]}"); do  # 0: the default, i: variant i
      name=default env_args=()
      [ "$i" = 0 ] || { read -ra env_args <<< "${variants[$((i - 1))]}"; name=switch$i; }
      rm -rf "/tmp/ab_$name"
      AB_RUN_ARGS="--run-dir /tmp/ab_$name --set train.profile_steps=[16,17]" \
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" ab_step "${name}_traced" "${env_args[@]}"
      read_trace "/tmp/ab_$name/profile" "$OUT/${name}_traced"
    done
  fi
  for i in "${!variants[@]}"; do echo "switch$((i + 1)): ${variants[$i]}"; done
  python3 scripts/gpu_summary.py "$OUT" 2>&1 | tail -12
  for f in "$OUT"/*.breakdown.md; do
    [ -f "$f" ] && echo "== $f" && sed -n '/^| category/,/^$/p;/^Largest/,/^Device/p' "$f"
  done
  # shellcheck disable=SC2046  # the run's files, by name
  (cd "$OUT" && tar -czf ab.tgz $(ls ./*.json ./*.md ./*.log ./*.txt 2>/dev/null) &&
    find . -maxdepth 1 -type f ! -name ab.tgz -delete)
  exit 0
fi
step gather_gmm 240 python3 scripts/bench_gather_gmm.py ${GATHER_ARGS:-} --out "$OUT/gather_gmm.json"
if [ -d .old ]; then
  (cd .old && PYTHONPATH=/tmp/site:$PWD step xmoe_before 180 python3 scripts/bench_train_step.py \
    --config configs/tiny_small_shape.yaml --steps "$STEPS" --out "$OUT/xmoe_before.json" ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} \
    ${SHAPES:-})
fi
OUT=$OUT/peers PEERS_ROWS="${PEERS_ROWS:-xmoe_none titan_none16}" PEERS_BUDGET=${PEERS_BUDGET:-330} STEPS=$STEPS \
  bash scripts/bench_peers.sh > "$OUT/peers.log" 2>&1
cp "$OUT/peers/table.md" "$OUT/peers_table.md" 2>/dev/null
cp "$OUT/peers/peers.json" "$OUT/peers.json" 2>/dev/null
rm -rf "$OUT/peers"
python3 scripts/gpu_summary.py "$OUT" 2>&1 | tail -5
cat "$OUT/steps.txt"; tail -30 "$OUT/gather_gmm.log"; cat "$OUT/peers_table.md" 2>/dev/null || tail -20 "$OUT/peers.log"
