#!/usr/bin/env bash
# GPU batch: the paper's Small at full depth on the 4 GPUs of one host (issues 29 and 30;
# benchmarks/depth.md, benchmarks/exchange.md). From the repo root, wheels in .whl/:
#
#   bash scripts/gpu_bench_depth.sh                 # about 9.5 minutes
#   DRY_RUN=1 OUT=/tmp/dry bash scripts/gpu_bench_depth.sh   # the CPU check (scripts/gpu_env.sh)
#
# configs/small.yaml (28 layers, H 2048, 64 experts of 1408, top-6, dropless pft, learned softmax
# router) at EP N (default 4; N=8 on an 8-GPU host): train.batch_size=32N as 4 micro-batches of 16k tokens per GPU, model.remat=save_exchange,
# fp32 state, synthetic tokens; 100 steps logged every 10 (throughput of the last 20 = the last two
# windows), a profile of steps 60-61 (STEPS x 0.6) read by scripts/kernel_overlap.py and scripts/step_breakdown.py.
# TRANSPORT (default exact) is the exchange; if that run fails within its first 240 s (before any
# training), the same run follows with bucketed. STEPS, REMAT, EXTRA (more --set overrides) change it.
# The force-balanced row (the vendors' convention; label it): EXTRA='--set model.moe.force_balance=true'.
# The run directory's metrics.jsonl (every 10 steps: buffers, bytes, exchange_rows, bound ratio,
# imbalance) survives a timeout. Everything lands in $OUT/depth.tgz beside $OUT/table.md.
set -u
source "$(dirname "$0")/gpu_env.sh"
RUNS=$OUT/runs
mkdir -p "$RUNS"
STEPS=${STEPS:-100}
N=${N:-4}  # GPUs = the expert axis; 32 sequences per GPU per step as 4 micro-batches of 8
LIMIT=${LIMIT:-540}
FIRST=$((STEPS * 6 / 10))  # the traced steps: FIRST, FIRST + 1
env_record "$RUNS/env.txt"

depth() {  # name limit transport: the full-depth run
  local name=$1 limit=$2 transport=$3
  # shellcheck disable=SC2086  # EXTRA is a list of --set overrides
  JSON_DIR=$RUNS BATCH_PER_GPU=32 ep_step "$name" "$limit" "$N" "$STEPS" configs/small.yaml \
    --log-every 10 --run-dir "$RUNS/$name" --set train.micro_batch_size=$((8 * N)) \
    --set model.remat="${REMAT:-save_exchange}" --set parallel.transport="$transport" \
    --set train.tensorboard=false --set "train.profile_steps=[$FIRST,$((FIRST + 1))]" ${EXTRA:-}
}

t0=$SECONDS
depth "depth_${TRANSPORT:-exact}" "$LIMIT" "${TRANSPORT:-exact}"
if [ ! -f "$RUNS/depth_${TRANSPORT:-exact}/metrics.jsonl" ] && ((SECONDS - t0 < 240)); then
  tail -20 "$OUT/depth_${TRANSPORT:-exact}.log"
  depth depth_bucketed $((LIMIT - (SECONDS - t0) - 20)) bucketed
fi
for run in "$RUNS"/depth_*/; do
  name=$(basename "$run")
  read_trace "$run/profile" "$RUNS/$name" "$OUT/$name.breakdown.png"
done
mv "$OUT"/*.log "$OUT/steps.txt" "$RUNS/" 2>/dev/null
python3 scripts/gpu_summary.py "$RUNS" > "$RUNS/summary.txt" 2>&1
python3 scripts/gpu_summary.py "$RUNS" --history > "$RUNS/history.md" 2>&1
{ cat "$RUNS/env.txt"; echo; cat "$RUNS/steps.txt"; echo; cat "$RUNS/summary.txt"; echo; cat "$RUNS/history.md"
  for f in "$RUNS"/*.overlap.txt "$RUNS"/*.breakdown.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
} > "$OUT/table.md"
pack depth "$RUNS"
cat "$OUT/table.md"
