#!/usr/bin/env bash
# GPU batch for the exchange at scale (issue 29; benchmarks/exchange.md and benchmarks/multigpu.md).
# On one host of 4 GPUs, from the repo root, wheels in .whl/ (scripts/peers_wheels.sh):
#
#   bash scripts/gpu_bench_exchange.sh            # all parts below, about 9 minutes
#   PARTS="exchange" bash scripts/gpu_bench_exchange.sh
#
# Parts (PARTS, default "exchange scaling"):
#   exchange  scripts/bench_exchange.py: the exchange alone, 16,384 rows x 2048 bf16 per pair, uniform /
#             hot pair / hot receiver: NCCL's all_to_all_single (torch, one process per GPU), JAX's dense
#             all_to_all at the fullest pair, our `exact` transport at 128 and 512 updates per peer and
#             ragged_all_to_all with one; then the dense and exact paths again with XLA's memcpy p2p.
#   scaling   weak scaling of the Small shapes x 4 layers (configs/tiny_small_shape.yaml) at 64k tokens
#             per GPU, 15 steps, throughput of steps 11-15: 1 GPU; 4 GPUs (EP 4) bucketed and exact with
#             overlap off; exact with overlap on (pipelined chunks + latency-hiding scheduler), traced over
#             steps 7-8 with scripts/kernel_overlap.py's report (and scripts/step_breakdown.py's, if present).
# CPU dry run (tiny shapes, fake devices; the torch row fails there):
#   OUT=/tmp/dry ROWS=64 STEPS=3 MATMUL_SIZE=256 XLA_FLAGS=--xla_force_host_platform_device_count=4 SHAPES="--set
#   model.hidden=64 --set model.num_heads=2 --set model.head_dim=32 --set model.moe.expert_hidden=32 --set
#   model.vocab_size=256 --set train.seq_len=32 --set model.scan_unroll=1" bash scripts/gpu_bench_exchange.sh
# Everything lands in $OUT/issue29.tgz (logs, JSON, reports) beside $OUT/table.md, which is printed last.
set -u
source "$(dirname "$0")/gpu_env.sh"
N=${N:-4}
CFG=configs/tiny_small_shape.yaml
PER_GPU=${BATCH_PER_GPU:-32}
STEPS=${STEPS:-15}
RUNS=$OUT/runs
mkdir -p "$RUNS"
nvidia-smi topo -m > "$RUNS/topo.txt" 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --format='commit %H %cs' 2>/dev/null
  python3 -c 'import jax; print("jax", jax.__version__)'; date -u; } > "$RUNS/env.txt" 2>&1

ts() {  # name timeout gpus scheduler overrides...: one bench_train_step run on the first `gpus` GPUs
  local name=$1 limit=$2 n=$3 sched=$4; shift 4
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) XMOE_XLA_SCHEDULER=$sched \
    step "$name" "$limit" python3 scripts/bench_train_step.py --config $CFG --steps "$STEPS" --log-every 5 \
    --out "$RUNS/$name.json" --set mesh.expert="$n" --set mesh.data=1 --set train.batch_size=$((PER_GPU * n)) \
    --set parallel.dispatch=pft --set train.tensorboard=false ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} "$@" ${SHAPES:-}
}

for part in ${PARTS:-exchange scaling}; do
  case $part in
    exchange)
      step ex_jax 200 python3 scripts/bench_exchange.py jax --rows "${ROWS:-16384}" --updates 1,128,512 --out "$RUNS/ex_jax.json"
      step ex_torch 120 python3 -m torch.distributed.run --nproc_per_node "$N" scripts/bench_exchange.py torch \
        --rows "${ROWS:-16384}" --out "$RUNS/ex_torch.json"
      step ex_memcpy 100 env XLA_FLAGS="--xla_gpu_use_memcpy_local_p2p=true" python3 scripts/bench_exchange.py jax \
        --rows "${ROWS:-16384}" --updates 512 --paths dense,exact512 --label memcpy_p2p --out "$RUNS/ex_memcpy.json"
      python3 scripts/bench_exchange.py table "$RUNS"/ex_*.json > "$RUNS/exchange_table.md" 2>&1 ;;
    scaling)
      ts ws_1gpu 150 1 default
      ts ws_4gpu_bucketed 150 "$N" default --set parallel.transport=bucketed
      ts ws_4gpu_exact 150 "$N" default --set parallel.transport=exact
      ts ws_4gpu_exact_on 170 "$N" latency_hiding --set parallel.transport=exact --set parallel.overlap=both \
        --set parallel.overlap_chunks=2 --set parallel.xla_scheduler=latency_hiding \
        --set "train.profile_steps=[7,8]" --run-dir "$RUNS/trace_on"
      python3 scripts/kernel_overlap.py "$RUNS/trace_on/profile" --out "$RUNS/overlap_on.json" \
        > "$RUNS/overlap_on.txt" 2>&1
      if [ -f scripts/step_breakdown.py ]; then
        python3 scripts/step_breakdown.py "$RUNS/trace_on/profile" --steps 2 --out "$RUNS/breakdown_on.json" \
          > "$RUNS/breakdown_on.md" 2>&1
      fi
      rm -rf "$RUNS/trace_on/checkpoints"
      ;;
    *) echo "PARTS: unknown part '$part' (exchange scaling)"; exit 2 ;;
  esac
done

mv "$OUT"/*.log "$OUT/steps.txt" "$RUNS/" 2>/dev/null
python3 scripts/gpu_summary.py "$RUNS" > "$RUNS/summary.txt" 2>&1
{ cat "$RUNS/env.txt"; echo; cat "$RUNS/steps.txt"; echo; cat "$RUNS/exchange_table.md" 2>/dev/null; echo
  cat "$RUNS/summary.txt"; echo; cat "$RUNS/overlap_on.txt" 2>/dev/null; cat "$RUNS/breakdown_on.md" 2>/dev/null
} > "$OUT/table.md"
# the trace itself stays only if small (the device tool brings back 16 MiB a file)
tar -czf "$OUT/issue29.tgz" -C "$OUT" runs && rm -rf "$RUNS"
[ "$(stat -c %s "$OUT/issue29.tgz")" -lt 15000000 ] || {
  tar -xzf "$OUT/issue29.tgz" -C "$OUT" && rm -rf "$RUNS/trace_on/profile" && tar -czf "$OUT/issue29.tgz" -C "$OUT" runs
  rm -rf "$RUNS"; }
cat "$OUT/table.md"
