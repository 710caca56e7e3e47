#!/usr/bin/env bash
# GPU batches for training at depth and the self-sizing exchange (benchmarks/scale.md, benchmarks/exchange.md).
#
#   bash scripts/gpu_bench_scale.sh h100a    # one H100: kernel + attention GPU tests, train steps (XLA / cuDNN attention)
#   bash scripts/gpu_bench_scale.sh h100b    # one H100: the planner on the real GPU, compile time 4 vs 28 layers
#   bash scripts/gpu_bench_scale.sh x2a      # 2x H200: MoE layer, bucketed vs padded vs ragged, uniform and skewed; ragged repro
#   bash scripts/gpu_bench_scale.sh x2b      # 2x H200: rbd layer (2 nodes x 1), overlap chunks, emulated transport
#   bash scripts/gpu_bench_scale.sh x2c      # 2x H200: Small at depth (the deepest that fits), dropless pft and rbd
#
#   DRY_RUN=1 OUT=/tmp/dry bash scripts/gpu_bench_scale.sh x2c   # a part's CPU check (scripts/gpu_env.sh)
# Every step has its own timeout and writes a log and JSON under $OUT; a short table comes last.
set -u
source "$(dirname "$0")/gpu_env.sh"
TINY=configs/tiny_small_shape.yaml
SMALL=configs/small.yaml

case "${1:-}" in
  h100a)
    export "$(gpus 1)"
    env_record "$OUT/gpu.txt"
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
    export "$(gpus 1)"
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
    export "$(gpus 2)"
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    L="scripts/bench_moe_layer.py --tokens-per-device $TOKENS --skews 0,1.0 --iters $ITERS"
    step layer_bucketed 240 python3 $L --modes pft,padded:1.25 --transport bucketed --recv-buffer-factor auto \
      --stages pft --out "$OUT/layer_bucketed.json"
    for preset in default sendrecv; do  # why did the NCCL send/recv path hang? (XMOE_RAGGED_A2A presets)
      XMOE_RAGGED_A2A=$preset step "repro_$preset" 50 python3 scripts/repro_ragged_sendrecv.py
      tail -2 "$OUT/repro_$preset.log"
    done
    step layer_ragged 150 python3 $L --modes pft --transport ragged --recv-buffer-factor auto --no-exchange \
      --out "$OUT/layer_ragged.json"
    tail -12 "$OUT/layer_bucketed.log"; tail -5 "$OUT/layer_ragged.log"
    cat "$OUT/steps.txt" ;;
  x2b)
    export "$(gpus 2)"
    L="scripts/bench_moe_layer.py --tokens-per-device $TOKENS --skews 0,1.0 --iters $ITERS"
    if [ -n "${PICK:-}" ]; then  # the depth x2c picked: rbd training at that depth first
      set -- $PICK
      S="--set train.batch_size=16 --set train.micro_batch_size=8 --set mesh.expert=2 --set model.moe.capacity_factor=null"
      train_step "small$1_rbd" 170 40 $SMALL $S --set model.num_layers=$1 --set model.remat=$2 \
        --set parallel.dispatch=rbd --set mesh.expert_nodes=2
    fi
    step layer_rbd 150 python3 $L --modes rbd --transport bucketed --recv-buffer-factor auto --expert-nodes 2 \
      --no-exchange --out "$OUT/layer_rbd.json"
    step layer_overlap 120 python3 $L --modes pft --transport bucketed --recv-buffer-factor auto --no-exchange \
      --skews 0 --overlap-chunks 2 --out "$OUT/layer_overlap.json"
    for f in layer_rbd layer_overlap; do tail -5 "$OUT/$f.log"; done
    summary
    cat "$OUT/steps.txt" ;;
  x2d)  # x2c's pft run again (after the micro-batch peak fix): the adaptive ladder settles lower
    export "$(gpus 2)"
    S="--set train.batch_size=16 --set train.micro_batch_size=8 --set mesh.expert=2 --set model.moe.capacity_factor=null"
    train_step small28_pft_v2 260 105 $SMALL $S --set model.num_layers=28 --set model.remat=full \
      --set parallel.dispatch=pft
    summary ;;
  x2c)
    export "$(gpus 2)"
    # the deepest Small-width model that fits 2 GPUs: ask the planner on the real GPUs, deepest first
    S="--set train.batch_size=16 --set train.micro_batch_size=8 --set mesh.expert=2 --set model.moe.capacity_factor=null"
    pick=""
    for cand in "28 save_dots" "28 full" "24 full"; do
      set -- $cand
      step "plan_small$1_$2" 75 python3 -m xmoe_jax.cli_plan --config $SMALL --devices 2 --real-devices $S \
        --set parallel.dispatch=pft --set model.num_layers=$1 --set model.remat=$2 --device-memory 128GiB \
        --out "$OUT/plan_small$1_$2.json"
      if grep -q ": fits" "$OUT/plan_small$1_$2.log"; then pick="$1 $2"; break; fi
    done
    set -- $pick
    echo "picked layers=$1 remat=$2" | tee -a "$OUT/steps.txt"
    D="--set model.num_layers=$1 --set model.remat=$2"
    train_step "small$1_pft" 250 105 $SMALL $S $D --set parallel.dispatch=pft
    train_step small4_pft 60 6 $SMALL $S --set model.num_layers=4 --set model.remat=$2 --set parallel.dispatch=pft
    summary ;;
  *) echo "usage: $0 h100a|h100b|x2a|x2b|x2c|x2d"; exit 2 ;;
esac
