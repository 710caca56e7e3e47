#!/usr/bin/env bash
# GPU batches for training at depth and the self-sizing exchange (benchmarks/scale.md, benchmarks/exchange.md).
#
#   bash scripts/gpu_bench_scale.sh h100a    # one H100: kernel + attention GPU tests, train steps (XLA / cuDNN attention)
#   bash scripts/gpu_bench_scale.sh h100b    # one H100: the planner on the real GPU, compile time 4 vs 28 layers
#   bash scripts/gpu_bench_scale.sh x2a      # 2x H200: MoE layer and exchange transports, uniform and skewed routing
#   bash scripts/gpu_bench_scale.sh x2b      # 2x H200: Small at depth, dropless pft and rbd with adaptive buffers
#
# Every step has its own timeout and writes a log and JSON under $OUT; a short table comes last.
set -u
source "$(dirname "$0")/gpu_env.sh"
TINY=configs/tiny_small_shape.yaml
SMALL=configs/small.yaml
summary() {
  python3 - "$OUT" <<'EOF'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(path))
    if "tokens_per_s" in r:
        print(f"{os.path.basename(path):<40} tok/s {r['tokens_per_s']:>10.0f}  TFLOP/s {r['tflops_per_device']:6.1f}  "
              f"MFU {100 * (r['mfu_vs_datasheet'] or 0):5.1f}%  first step {r['first_step_s'] or 0:6.1f}s  "
              f"peak {(r['peak_bytes_in_use'] or 0) / 2**30:6.1f} GiB  loss {r['first_loss']:.3f}->{r['final_loss']:.3f}  "
              f"{r.get('exchange', {})}")
    elif "peak" in r:
        print(f"{os.path.basename(path):<40} plan peak {r['peak'] / 2**30:6.2f} GiB  temp {r['temporaries'] / 2**30:6.2f} GiB  "
              f"compile {r['compile_s']:6.1f}s")
EOF
  cat "$OUT/steps.txt"
}

case "${1:-}" in
  h100a)
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
    step gpu_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_scale.py
    # the refactor check: the same model as benchmarks/train_step.md (XLA attention), pft dropless
    train_step train_pft_xla 140 30 $TINY --set parallel.dispatch=pft --set model.moe.capacity_factor=null \
      --set model.attention=xla
    # the scale check: attention auto (cuDNN), pft dropless; then a bigger batch
    train_step train_pft_auto 140 30 $TINY --set parallel.dispatch=pft --set model.moe.capacity_factor=null
    train_step train_pft_auto_b16 160 30 $TINY --set parallel.dispatch=pft --set model.moe.capacity_factor=null \
      --set train.batch_size=16
    summary ;;
  h100b)
    # where the train step's time went after the layer stacks and the chunked loss (a regression hunt)
    P="--set parallel.dispatch=pft --set model.moe.capacity_factor=null"
    train_step train_pft_unrolled 120 30 $TINY $P --set model.unroll_layers=true
    train_step train_pft_fullloss 120 30 $TINY $P --set model.loss_chunk=0
    train_step train_pft_unrolled_fullloss 120 30 $TINY $P --set model.unroll_layers=true --set model.loss_chunk=0
    step plan_tiny_gpu 150 python3 -m xmoe_jax.cli_plan --config $TINY --devices 1 --real-devices \
      --set parallel.dispatch=pft --set model.moe.capacity_factor=null --device-memory 80GB --out "$OUT/plan_tiny_gpu.json"
    step plan_small4_gpu 100 python3 -m xmoe_jax.cli_plan --config $SMALL --devices 1 --real-devices \
      --set model.num_layers=4 --set mesh.expert=1 --set train.batch_size=8 --out "$OUT/plan_small4_gpu.json"
    step plan_small28_gpu 120 python3 -m xmoe_jax.cli_plan --config $SMALL --devices 1 --real-devices \
      --set mesh.expert=1 --set train.batch_size=8 --out "$OUT/plan_small28_gpu.json"
    summary ;;
  x2a)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    L="scripts/bench_moe_layer.py --tokens-per-device 16384 --skews 0,1.0 --iters 10"
    step layer_bucketed 200 python3 $L --modes pft,padded:1.25 --transport bucketed --recv-buffer-factor auto \
      --stages pft --out "$OUT/layer_bucketed.json"
    step layer_ragged 150 python3 $L --modes pft --transport ragged --recv-buffer-factor auto --no-exchange \
      --out "$OUT/layer_ragged.json"
    step layer_rbd 150 python3 $L --modes rbd --transport bucketed --recv-buffer-factor auto --expert-nodes 2 \
      --no-exchange --out "$OUT/layer_rbd.json"
    step layer_overlap 150 python3 $L --modes pft --transport bucketed --recv-buffer-factor auto --no-exchange \
      --skews 0 --overlap-chunks 2 --out "$OUT/layer_overlap.json"
    for preset in default sendrecv; do  # why did the NCCL send/recv path hang? (XMOE_RAGGED_A2A presets)
      XMOE_RAGGED_A2A=$preset step "repro_$preset" 45 python3 scripts/repro_ragged_sendrecv.py
      tail -2 "$OUT/repro_$preset.log"
    done
    for f in layer_bucketed layer_ragged layer_rbd layer_overlap; do tail -8 "$OUT/$f.log"; done
    cat "$OUT/steps.txt" ;;
  x2b)
    S="--set train.batch_size=16 --set model.remat=save_dots --set train.micro_batch_size=8 --set mesh.expert=2
       --set model.moe.capacity_factor=null"
    train_step small28_pft 330 120 $SMALL $S --set parallel.dispatch=pft
    train_step small28_rbd 230 100 $SMALL $S --set parallel.dispatch=rbd --set mesh.expert_nodes=2
    train_step small4_pft 90 10 $SMALL $S --set parallel.dispatch=pft --set model.num_layers=4
    summary ;;
  *) echo "usage: $0 h100a|h100b|x2a|x2b"; exit 2 ;;
esac
