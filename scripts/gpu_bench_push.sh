#!/usr/bin/env bash
# GPU batch for the push exchange kernel (issue 36; benchmarks/exchange.md). On one host of N GPUs
# (2 to develop, 4 to measure), from the repo root, wheels in .whl/ (scripts/peers_wheels.sh):
#
#   bash scripts/gpu_bench_push.sh                 # about 4 minutes on 2 or 4 GPUs
#
# Steps: a small correctness-first run of the Mosaic kernel alone (checked bit for bit against NumPy,
# 60 s limit, so a hang costs a minute); then scripts/bench_exchange.py at 16,384 rows x 2048 bf16 per
# pair, uniform / hot pair / hot receiver: JAX's dense all_to_all, our `exact` (512 updates per peer),
# push at $PUSH (CTAs[xUPDATES per peer]), and NCCL's all_to_all_single through torch, one table.
# CPU dry run (tiny rows, fake devices; push runs its XLA reference there, the torch row fails):
#   OUT=/tmp/dry ROWS=64 CHECK_ROWS=16 XLA_FLAGS=--xla_force_host_platform_device_count=4 bash scripts/gpu_bench_push.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
N=${N:-$(python3 -c 'import jax; print(jax.device_count())' 2>/dev/null || echo 2)}
PUSH=${PUSH:-8,16,32,64,32x16}
ROWS=${ROWS:-16384}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m
  git log -1 --format='commit %H %cs' 2>/dev/null; python3 -c 'import jax; print("jax", jax.__version__)'; date -u
} > "$OUT/env.txt" 2>&1
step push_quick 60 python3 scripts/bench_exchange.py jax --rows 1024 --check-rows "${CHECK_ROWS:-512}" --updates "" \
  --push 32 --out "$OUT/push_quick.json"
step ex_jax 240 python3 scripts/bench_exchange.py jax --rows "$ROWS" --check-rows "${CHECK_ROWS:-512}" --updates 512 \
  --push "$PUSH" --out "$OUT/ex_jax.json"
step ex_torch 120 python3 -m torch.distributed.run --nproc_per_node "$N" scripts/bench_exchange.py torch \
  --rows "$ROWS" --out "$OUT/ex_torch.json"
python3 scripts/bench_exchange.py table "$OUT"/ex_*.json > "$OUT/table.md" 2>&1
cat "$OUT/steps.txt" "$OUT/table.md"
tail -5 "$OUT/push_quick.log"
