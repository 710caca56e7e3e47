#!/usr/bin/env bash
# GPU batch for the DeepSeek-V2/V3 architecture (benchmarks/deepseek.md): multi-head latent attention
# against MHA of the same active size, and the MLA attention backends' correctness.
#
#   bash scripts/gpu_bench_deepseek.sh h100    # one H100, under 6 minutes: MLA GPU tests, MLA vs MHA train steps
#   bash scripts/gpu_bench_deepseek.sh x4      # 4x H200: the planner on the GPUs, DeepSeek-V2-Lite at full depth, pft and rbd
#   DRY_RUN=1 OUT=/tmp/dry bash scripts/gpu_bench_deepseek.sh h100   # tiny shapes on the CPU (scripts/gpu_env.sh)
#
# The model: configs/deepseek_v2_lite.yaml cut to 4 layers (1 dense + 3 MoE: 64 routed experts of 1408
# + 2 shared, top-6), one GPU, 8 x 2048 tokens per step, dropless pft, no rematerialisation, 30 steps.
# The MHA twin replaces MLA (16 heads, 128 + 64 query/key and 128 value dims, KV latent 512: 13.76M
# weights per layer) by MHA with 13 heads of 128 (4 * 2048 * 13 * 128 = 13.63M per layer), so both
# have the same active parameters per token to 0.1% (xmoe-params); RoPE (YaRN) and the MoE layers are
# the same. MFU counts each model's own attention FLOPs (train/metrics.py). `SHAPES` adds --set
# overrides to every train step (the CPU check of this script runs it with tiny shapes).
# x4: configs/deepseek_v2_lite.yaml as shipped (27 layers, experts over 4 GPUs, 8 micro-batches of 4 x
# 4096 tokens, full rematerialisation), dropless pft, then rbd with the 4 GPUs as 2 simulated nodes.
# Every step has its own timeout and writes a log and JSON under $OUT; a short table comes last.
set -u
source "$(dirname "$0")/gpu_env.sh"
V2LITE=configs/deepseek_v2_lite.yaml

case "${1:-}" in
  h100)
    export "$(gpus 1)"
    env_record "$OUT/gpu.txt"
    PARAMS='import sys; from xmoe_jax.cli import params_main; sys.exit(params_main(sys.argv[1:]))'
    python3 -c "$PARAMS" --config $V2LITE --set model.num_layers=4 > "$OUT/params_mla.txt" 2>&1
    python3 -c "$PARAMS" --config $V2LITE --set model.num_layers=4 --set model.attention_type=mha --set model.mla=null \
      --set model.num_heads=13 --set model.head_dim=128 > "$OUT/params_mha.txt" 2>&1
    # MLA's fast backends against XLA in bf16 (cuDNN takes K = 192 on Hopper; Pallas pads to 256)
    step gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mla.py
    D="--set model.num_layers=4 --set mesh.expert=1 --set train.batch_size=8 --set train.micro_batch_size=null
       --set train.seq_len=2048 --set model.remat=none --set parallel.dispatch=pft --set model.moe.capacity_factor=null"
    # shellcheck disable=SC2086
    train_step mla 110 30 $V2LITE $D
    # shellcheck disable=SC2086
    train_step mha 110 30 $V2LITE $D --set model.attention_type=mha --set model.mla=null --set model.num_heads=13 \
      --set model.head_dim=128
    summary ;;
  x4)
    export "$(gpus 4)"
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    # shellcheck disable=SC2086
    step plan_v2lite 300 python3 -m xmoe_jax.cli_plan --config $V2LITE --devices 4 --real-devices \
      --device-memory 141GiB --out "$OUT/plan_v2lite.json" ${SHAPES:-}
    train_step v2lite_pft 600 20 $V2LITE --set parallel.dispatch=pft
    train_step v2lite_rbd 600 20 $V2LITE --set parallel.dispatch=rbd --set mesh.expert_nodes=2
    summary ;;
  *) echo "usage: $0 h100|x4"; exit 2 ;;
esac
