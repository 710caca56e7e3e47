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
