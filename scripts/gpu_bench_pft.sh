#!/usr/bin/env bash
# The GPU measurements of benchmarks/pft.md in one device call. Usage (repo root, GPU machine):
#   bash scripts/gpu_bench_pft.sh h100   # 1 GPU: MoE layer (pft vs padded vs dense) + pft train step
#   bash scripts/gpu_bench_pft.sh ep2    # 2 GPUs: MoE layer with EP=2 under two ragged all-to-all presets
#   DRY_RUN=1 OUT=/tmp/dry bash scripts/gpu_bench_pft.sh h100   # the CPU check (scripts/gpu_env.sh)
# Writes JSON and logs under ${OUT:-/tmp/out} (rc and time of each in steps.txt). Needs grain/jax-triton
# wheels in .whl (benchmarks/README.md, "Running"). TOKENS (default 16384) and ITERS (default 10) size
# the layer runs (the CPU check: 64 and 1).
set -u
source scripts/gpu_env.sh
LAYER="scripts/bench_moe_layer.py --tokens-per-device $TOKENS --iters $ITERS --skews 0,1.0"
case "${1:-h100}" in
  h100)
    step moe_layer_1gpu 400 env "$(gpus 1)" python3 $LAYER --modes pft,padded:1.25,padded:1.0,dense \
      --out "$OUT/moe_layer_1gpu.json"
    tail -12 "$OUT/moe_layer_1gpu.log"
    train_step train_step_pft 300 30 configs/tiny_small_shape.yaml --set parallel.dispatch=pft \
      --set model.moe.capacity_factor=null
    grep -E "step +30|tokens_per_s|mfu|ratio" "$OUT/train_step_pft.log" ;;
  ep2)
    for preset in default sendrecv; do
      XMOE_RAGGED_A2A=$preset step "moe_layer_ep2_$preset" 300 env "$(gpus 2)" python3 $LAYER \
        --modes pft,padded:1.25,padded:1.0 --out "$OUT/moe_layer_ep2_$preset.json"
      echo "== preset $preset"; tail -12 "$OUT/moe_layer_ep2_$preset.log"
    done ;;
esac
