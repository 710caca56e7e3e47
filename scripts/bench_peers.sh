#!/usr/bin/env bash
# The peer table on one GPU in one call (issue 25, Build item 6): xmoe_jax (scripts/bench_train_step.py,
# recomputation none and full), MaxText 0.2.5 and torchtitan 0.2.2 on configs/tiny_small_shape.yaml's
# shapes (X-MoE Small layer x 4, batch 32 x 2048, bf16 compute, fp32 params, AdamW), then ONE table:
# tokens/s, MFU (the repo's formula for all), peak memory and the ratios to xmoe_jax.
#
#   bash scripts/bench_peers.sh                       # from the repo root, on the GPU machine
#   PEERS_ROWS="xmoe_none maxtext_full" STEPS=12 bash scripts/bench_peers.sh
#
# Wheels (no internet there): scripts/peers_wheels.sh fills .whl/ (grain, jax-triton: installed for
# xmoe_jax by scripts/gpu_env.sh) and .whl/peers/ (MaxText, torchtitan and what they import that the
# machine lacks: installed apart in /tmp/site_peers, so xmoe_jax runs on the machine's own flax;
# PEERS_WHEELS names another folder for them).
# pathwaysutils, xprof and Hugging Face datasets are stubbed (scripts/peers/stubs).
# Rows (PEERS_ROWS, default all, in this order): xmoe_none xmoe_full maxtext_full maxtext_minimal
# titan_selective titan_none16 titan_full (torchtitan without AC runs out of memory at batch 32: batch 16).
# Expert parallel on N GPUs of the machine (issue 30, Build item 5; N from the name, EP = N, data 1, the
# config's batch per GPU, so 32 x 2048 = 64k tokens per GPU and a global batch of 32 x N):
#   xmoe_epN, xmoe_epN_full   scripts/bench_train_step.py, mesh.expert=N, dispatch pft (dropless), one
#                             process; recomputation none / full
#   maxtext_epN, maxtext_epN_minimal   maxtext_run.py --ep N (ici_expert_parallelism=N), one process
#   titan_epN, titan_epN_sel, titan_epN_none   torchrun --standalone --nproc_per_node N titan_run.py
#                             --ep N (expert_parallel_degree=N on FSDP2 over the N ranks): AC full,
#                             selective:op, none
#   PEERS_ROWS=ep4 is "xmoe_ep4 maxtext_ep4 titan_ep4" (epN likewise). Each call that runs a peer's EP row runs
#   xmoe_epN too: the table's ratios are to it (per GPU), from the same call. Split the rows over
#   calls of 10 minutes, e.g. PEERS_BUDGET=570 PEERS_ROWS="ep4" then
#   PEERS_BUDGET=570 PEERS_ROWS="xmoe_ep4 titan_ep4_sel titan_ep4_none".
# CPU dry run of the xmoe_jax rows (tiny shapes; the EP rows on fake CPU devices: scripts/gpu_env.sh):
#   DRY_RUN=1 OUT=/tmp/dry PEERS_ROWS="xmoe_none xmoe_full xmoe_ep4" bash scripts/bench_peers.sh
# Every run has its own timeout, clipped to what is left of PEERS_BUDGET seconds (default 500).
# CPU dry run of the harness itself (tiny config, a Python 3.12 venv holding the peers):
#   PEERS_PYTHON=/tmp/peersvenv/bin/python PEERS_MAXTEXT_ARGS=--cpu PEERS_TITAN_ARGS="--cpu --no-compile" \
#   CONFIG=tiny.yaml MATMUL_SIZE=256 bash scripts/bench_peers.sh
#   (+ DRY_RUN=1 PEERS_ROWS="xmoe_ep4 maxtext_ep4 titan_ep4", PEERS_PYTHON of a venv whose
#   python has both MaxText and torch, or PEERS_TITAN_PYTHON for another one that has torch)
# Output under $OUT (5 files: the device tool brings back 8): peers.json (the table rows and every
# run's JSON), table.md, env.txt, steps.txt, runs.tgz (each run's JSON and log); PEERS_KEEP=1 leaves
# $OUT/runs/ unpacked instead. The table is printed last.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # scripts/, or .peers/scripts/ when carried beside a tree
# From the repo root: the tree's own gpu_env.sh and bench_train_step.py (its xmoe_jax, as it stands).
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh  # OUT, PYTHONPATH (/tmp/site with grain, the repo), NCCL_NVLS_ENABLE=0
CONFIG=${CONFIG:-configs/tiny_small_shape.yaml}
STEPS=${STEPS:-15}
BUDGET=${PEERS_BUDGET:-500}
ROWS=${PEERS_ROWS:-xmoe_none xmoe_full maxtext_full maxtext_minimal titan_selective titan_none16 titan_full}
expanded=""
for row in $ROWS; do  # epN: the shorthand for xmoe_epN maxtext_epN titan_epN
  case $row in ep[0-9]*) expanded="$expanded xmoe_$row maxtext_$row titan_$row" ;; *) expanded="$expanded $row" ;; esac
done
ROWS=$expanded
RUNS=$OUT/runs
mkdir -p "$RUNS"
T0=$SECONDS
export PYTHONUNBUFFERED=1 DECOUPLE_GCLOUD=TRUE

PEERS_SITE=/tmp/site_peers
WHEELS=${PEERS_WHEELS:-.whl/peers}
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ -z "${PEERS_PYTHON:-}" ]; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$PEERS_SITE" "$WHEELS"/*.whl || echo "peers wheels: install failed" | tee -a "$RUNS/steps.txt"
fi
PEERS_PATH=$HERE/peers/stubs:$PEERS_SITE:$PYTHONPATH

run() {  # name limit command...: one run, its own timeout clipped to the budget left
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0) - 10))
  if ((left < 30)); then
    echo "$name skipped: ${left}s of the ${BUDGET}s budget left" | tee -a "$RUNS/steps.txt"
    return
  fi
  ((limit > left)) && limit=$left
  local t=$SECONDS
  timeout "$limit" "$@" > "$RUNS/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t))s (limit ${limit}s)" | tee -a "$RUNS/steps.txt"
}
xmoe() {  # name limit overrides...
  local name=$1 limit=$2; shift 2
  # shellcheck disable=SC2086  # SHAPES is a list of --set overrides (DRY_RUN: tiny)
  run "$name" "$limit" python3 scripts/bench_train_step.py --config "$CONFIG" --steps "$STEPS" \
    --out "$RUNS/$name.json" ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} "$@" ${SHAPES:-}
}
PY=${PEERS_PYTHON:-python3}
# shellcheck disable=SC2086  # PEERS_*_ARGS are lists of arguments
maxtext() {  # name limit policy args...
  local name=$1 limit=$2 policy=$3; shift 3
  run "$name" "$limit" env PYTHONPATH="$PEERS_PATH" "$PY" "$HERE/peers/maxtext_run.py" --config "$CONFIG" \
    --policy "$policy" --steps "$STEPS" --out "$RUNS/$name.json" ${PEERS_MAXTEXT_ARGS:-} "$@"
}
# shellcheck disable=SC2086
titan() {  # name limit ac args...
  local name=$1 limit=$2 ac=$3; shift 3
  run "$name" "$limit" env PYTHONPATH="$PEERS_PATH" "$PY" "$HERE/peers/titan_run.py" --config "$CONFIG" \
    --ac "$ac" --steps "$STEPS" --out "$RUNS/$name.json" ${PEERS_TITAN_ARGS:-} "$@"
}

BATCH=$(python3 -c "import sys; sys.path.insert(0, '$HERE/peers'); import peer_shape as s; print(s.load_shape('$CONFIG').batch_size)")
xmoe_ep() {  # name limit n overrides...: mesh.expert=n, data 1, the config's batch per GPU
  local name=$1 limit=$2 n=$3; shift 3
  # shellcheck disable=SC2046,SC2086  # ep_sets and SHAPES are lists of --set overrides
  run "$name" "$limit" env "$(gpus "$n")" python3 scripts/bench_train_step.py --config "$CONFIG" \
    --steps "$STEPS" --out "$RUNS/$name.json" ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} \
    $(BATCH_PER_GPU=$BATCH ep_sets "$n") --set model.moe.capacity_factor=null "$@" ${SHAPES:-}
}
# shellcheck disable=SC2086
maxtext_ep() {  # name limit n policy: one process over n devices, ici_expert_parallelism=n
  local name=$1 limit=$2 n=$3 policy=$4 flags=${XLA_FLAGS:-}
  # its EP exchange is XLA's ragged all-to-all: on GPUs give it the lowering xmoe_jax's rows get by
  # default (xmoe_jax/launch/xla_flags.py: the decomposer, 30x XLA's own ragged kernel on 2 H200s)
  if [ -n "${DRY_RUN:-}" ]; then
    flags="$flags --xla_force_host_platform_device_count=$n"
  else
    flags="$flags --xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
  fi
  run "$name" "$limit" env "$(gpus "$n")" XLA_FLAGS="$flags" PYTHONPATH="$PEERS_PATH" "$PY" "$HERE/peers/maxtext_run.py" \
    --config "$CONFIG" --policy "$policy" --steps "$STEPS" --ep "$n" --out "$RUNS/$name.json" ${PEERS_MAXTEXT_ARGS:-}
}
TPY=${PEERS_TITAN_PYTHON:-$PY}
# shellcheck disable=SC2086
titan_ep() {  # name limit n ac: torchrun, one process per GPU, expert_parallel_degree=n
  local name=$1 limit=$2 n=$3 ac=$4
  run "$name" "$limit" env PYTHONPATH="$PEERS_PATH" "$TPY" -m torch.distributed.run --standalone \
    --nproc_per_node "$n" "$HERE/peers/titan_run.py" --config "$CONFIG" --ac "$ac" --ep "$n" \
    --steps "$STEPS" --out "$RUNS/$name.json" ${PEERS_TITAN_ARGS:-}
}

env_record "$RUNS/env.txt"
for row in $ROWS; do
  case $row in
    xmoe_none) xmoe xmoe_none 150 ;;
    xmoe_full) xmoe xmoe_full 150 --set model.remat=full ;;
    maxtext_full) maxtext maxtext_full 180 full ;;
    maxtext_minimal) maxtext maxtext_minimal 180 minimal ;;
    titan_selective) titan titan_selective 240 selective:op ;;
    titan_full) titan titan_full 240 full ;;
    titan_none16) titan titan_none16 240 none --batch-size 16 ;;
    xmoe_ep[0-9]*_full) n=${row#xmoe_ep}; xmoe_ep "$row" 240 "${n%_full}" --set model.remat=full ;;
    xmoe_ep[0-9]*) xmoe_ep "$row" 240 "${row#xmoe_ep}" ;;
    maxtext_ep[0-9]*_minimal) n=${row#maxtext_ep}; maxtext_ep "$row" 270 "${n%_minimal}" minimal ;;
    maxtext_ep[0-9]*) maxtext_ep "$row" 270 "${row#maxtext_ep}" full ;;
    titan_ep[0-9]*_sel) n=${row#titan_ep}; titan_ep "$row" 270 "${n%_sel}" selective:op ;;
    titan_ep[0-9]*_none) n=${row#titan_ep}; titan_ep "$row" 270 "${n%_none}" none ;;
    titan_ep[0-9]*) titan_ep "$row" 270 "${row#titan_ep}" full ;;
    *) echo "PEERS_ROWS: unknown row '$row' (use xmoe_none xmoe_full maxtext_full maxtext_minimal" \
         "titan_selective titan_full titan_none16, or on N GPUs xmoe_epN[_full] maxtext_epN[_minimal]" \
         "titan_epN[_sel|_none], epN)" >&2; exit 2 ;;
  esac
done

# A failed run's log tail, so the reply shows why.
for log in "$RUNS"/*.log; do
  name=$(basename "$log" .log)
  [ -f "$RUNS/$name.json" ] || { echo "== $name: no JSON; its log ends:"; tail -5 "$log"; }
done
python3 "$HERE/peers/table.py" "$RUNS" --config "$CONFIG" --json "$OUT/peers.json" > "$OUT/table.md" 2>&1
cp "$RUNS/env.txt" "$RUNS/steps.txt" "$OUT/"
[ "${PEERS_KEEP:-0}" = 1 ] || pack runs "$RUNS"
cat "$OUT/env.txt" "$OUT/steps.txt" "$OUT/table.md"
