#!/usr/bin/env bash
# GPU batch: the paper's Small at full depth on the 4 GPUs of one host (issues 29 and 30;
# benchmarks/depth.md, benchmarks/exchange.md). From the repo root, wheels in .whl/:
#
#   bash scripts/gpu_bench_depth.sh                 # about 9.5 minutes
#
# configs/small.yaml (28 layers, H 2048, 64 experts of 1408, top-6, dropless pft, learned softmax
# router) at EP N (default 4; N=8 on an 8-GPU host): train.batch_size=32N as 4 micro-batches of 16k tokens per GPU, model.remat=save_exchange,
# fp32 state, synthetic tokens; 100 steps logged every 10 (throughput of the last 20 = the last two
# windows), a profile of steps 60-61 read by scripts/kernel_overlap.py and scripts/step_breakdown.py.
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
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --format='commit %H %cs' 2>/dev/null
  python3 -c 'import jax; print("jax", jax.__version__)'; date -u; } > "$RUNS/env.txt" 2>&1

depth() {  # name limit transport: the full-depth run
  local name=$1 limit=$2 transport=$3
  # shellcheck disable=SC2086  # EXTRA is a list of --set overrides
  step "$name" "$limit" python3 scripts/bench_train_step.py --config configs/small.yaml --steps "$STEPS" \
    --log-every 10 --out "$RUNS/$name.json" --run-dir "$RUNS/$name" \
    --set mesh.expert="$N" --set mesh.data=1 --set train.batch_size=$((32 * N)) --set train.micro_batch_size=$((8 * N)) \
    --set model.remat="${REMAT:-save_exchange}" --set parallel.transport="$transport" \
    --set train.tensorboard=false --set "train.profile_steps=[60,61]" ${EXTRA:-}
}

t0=$SECONDS
depth "depth_${TRANSPORT:-exact}" "$LIMIT" "${TRANSPORT:-exact}"
if [ ! -f "$RUNS/depth_${TRANSPORT:-exact}/metrics.jsonl" ] && ((SECONDS - t0 < 240)); then
  tail -20 "$OUT/depth_${TRANSPORT:-exact}.log"
  depth depth_bucketed $((LIMIT - (SECONDS - t0) - 20)) bucketed
fi
for run in "$RUNS"/depth_*/; do
  name=$(basename "$run")
  [ -d "$run/profile" ] || continue
  python3 scripts/kernel_overlap.py "$run/profile" --out "$RUNS/$name.overlap.json" > "$RUNS/$name.overlap.txt" 2>&1
  [ -f scripts/step_breakdown.py ] && python3 scripts/step_breakdown.py "$run/profile" --steps 2 \
    --out "$RUNS/$name.breakdown.json" --plot "$OUT/$name.breakdown.png" > "$RUNS/$name.breakdown.md" 2>&1
  rm -rf "$run/profile"  # tens of MB: the reports above keep what we read from it
done
mv "$OUT"/*.log "$OUT/steps.txt" "$RUNS/" 2>/dev/null
python3 scripts/gpu_summary.py "$RUNS" > "$RUNS/summary.txt" 2>&1
python3 - "$RUNS" > "$RUNS/history.md" 2>&1 <<'EOF'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/depth_*/metrics.jsonl")):
    print(f"## {path}\n\n| step | loss | tokens/s | MFU | factor | peak | wire/routed | bound R | imbalance |\n|---|---|---|---|---|---|---|---|---|")
    for line in open(path):
        r = json.loads(line)
        if "loss" not in r or "wire_bytes" not in r:
            continue
        wr = sum(r["wire_bytes"]) / max(sum(r["routed_bytes"]), 1)
        br = sum(r["exchange_bound_ratio"]) / len(r["exchange_bound_ratio"])
        print(f"| {r['step']} | {r['loss']:.4f} | {r.get('tokens_per_s') or 0:,.0f} | {100 * (r.get('mfu') or 0):.1f}% "
              f"| {r['buffer_factor']} | {r['peak_ratio']} | {wr:.2f} | {br:.2f} | {max(r['expert_imbalance']):.2f} |")
EOF
{ cat "$RUNS/env.txt"; echo; cat "$RUNS/steps.txt"; echo; cat "$RUNS/summary.txt"; echo; cat "$RUNS/history.md"
  for f in "$RUNS"/*.overlap.txt "$RUNS"/*.breakdown.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
} > "$OUT/table.md"
tar -czf "$OUT/depth.tgz" -C "$OUT" runs && rm -rf "$RUNS"
cat "$OUT/table.md"
