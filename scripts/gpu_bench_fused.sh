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
# CPU dry run (tiny shapes; the GPU-only rows fail there): OUT=/tmp/dry GATHER_ARGS=--tiny STEPS=2
#   MATMUL_SIZE=256 bash scripts/gpu_bench_fused.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
STEPS=${STEPS:-15}
step gather_gmm 240 python3 scripts/bench_gather_gmm.py ${GATHER_ARGS:-} --out "$OUT/gather_gmm.json"
if [ -d .old ]; then
  (cd .old && PYTHONPATH=/tmp/site:$PWD step xmoe_before 180 python3 scripts/bench_train_step.py \
    --config configs/tiny_small_shape.yaml --steps "$STEPS" --out "$OUT/xmoe_before.json" ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"})
fi
OUT=$OUT/peers PEERS_ROWS="${PEERS_ROWS:-xmoe_none titan_none16}" PEERS_BUDGET=${PEERS_BUDGET:-330} STEPS=$STEPS \
  bash scripts/bench_peers.sh > "$OUT/peers.log" 2>&1
cp "$OUT/peers/table.md" "$OUT/peers_table.md" 2>/dev/null
cp "$OUT/peers/peers.json" "$OUT/peers.json" 2>/dev/null
rm -rf "$OUT/peers"
python3 scripts/gpu_summary.py "$OUT" 2>&1 | tail -5
cat "$OUT/steps.txt"; tail -30 "$OUT/gather_gmm.log"; cat "$OUT/peers_table.md" 2>/dev/null || tail -20 "$OUT/peers.log"
