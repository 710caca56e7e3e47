#!/usr/bin/env bash
# The GPU measurements of benchmarks/pft.md in one device call. Usage (repo root, GPU machine):
#   bash scripts/gpu_bench_pft.sh h100   # 1 GPU: MoE layer (pft vs padded vs dense) + pft train step
#   bash scripts/gpu_bench_pft.sh ep2    # 2 GPUs: MoE layer with EP=2 under two ragged all-to-all presets
# Writes JSON and logs under ${OUT:-/tmp/out}. Needs grain/jax-triton wheels in .whl
# (benchmarks/README.md, "Running").
set -u
source scripts/gpu_env.sh
case "${1:-h100}" in
  h100)
    python3 scripts/bench_moe_layer.py --tokens-per-device 16384 --modes pft,padded:1.25,padded:1.0,dense \
      --skews 0,1.0 --out "$OUT/moe_layer_1gpu.json" > "$OUT/moe_layer_1gpu.log" 2>&1
    tail -12 "$OUT/moe_layer_1gpu.log"
    python3 scripts/bench_train_step.py --config configs/tiny_small_shape.yaml \
      --set parallel.dispatch=pft --set model.moe.capacity_factor=null --steps 30 \
      --out "$OUT/train_step_pft.json" > "$OUT/train_step_pft.log" 2>&1
    grep -E "step +30|tokens_per_s|mfu|ratio" "$OUT/train_step_pft.log" ;;
  ep2)
    for preset in default sendrecv; do
      XMOE_RAGGED_A2A=$preset python3 scripts/bench_moe_layer.py --tokens-per-device 16384 \
        --modes pft,padded:1.25,padded:1.0 --skews 0,1.0 --out "$OUT/moe_layer_ep2_$preset.json" \
        > "$OUT/moe_layer_ep2_$preset.log" 2>&1
      echo "== preset $preset"; tail -12 "$OUT/moe_layer_ep2_$preset.log"
    done ;;
esac
