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
#             steps 7-8 with scripts/kernel_overlap.py's and scripts/step_breakdown.py's reports.
# CPU dry run (tiny shapes, fake devices: scripts/gpu_env.sh; the torch row fails there):
#   DRY_RUN=1 OUT=/tmp/dry ROWS=64 bash scripts/gpu_bench_exchange.sh
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
env_record "$RUNS/env.txt"

ts() {  # name timeout gpus scheduler overrides...: one bench_train_step run on the first `gpus` GPUs
  local name=$1 limit=$2 n=$3 sched=$4; shift 4
  JSON_DIR=$RUNS BATCH_PER_GPU=$PER_GPU XMOE_XLA_SCHEDULER=$sched ep_step "$name" "$limit" "$n" "$STEPS" $CFG \
    --log-every 5 --set train.tensorboard=false "$@"
}

for part in ${PARTS:-exchange scaling}; do
  case $part in
    exchange)
      step ex_jax 200 env "$(gpus "$N")" python3 scripts/bench_exchange.py jax --rows "${ROWS:-16384}" --updates 1,128,512 \
        --out "$RUNS/ex_jax.json"
      step ex_torch 120 python3 -m torch.distributed.run --nproc_per_node "$N" scripts/bench_exchange.py torch \
        --rows "${ROWS:-16384}" --out "$RUNS/ex_torch.json"
      MEMCPY="--xla_gpu_use_memcpy_local_p2p=true"
      step ex_memcpy 100 env XLA_FLAGS="$MEMCPY" "$(XLA_FLAGS=$MEMCPY gpus "$N")" python3 scripts/bench_exchange.py jax \
        --rows "${ROWS:-16384}" --updates 512 --paths dense,exact512 --label memcpy_p2p --out "$RUNS/ex_memcpy.json"
      python3 scripts/bench_exchange.py table "$RUNS"/ex_*.json > "$RUNS/exchange_table.md" 2>&1 ;;
    scaling)
      ts ws_1gpu 150 1 default
      ts ws_4gpu_bucketed 150 "$N" default --set parallel.transport=bucketed
      ts ws_4gpu_exact 150 "$N" default --set parallel.transport=exact
      ts ws_4gpu_exact_on 170 "$N" latency_hiding --set parallel.transport=exact --set parallel.overlap=both \
        --set parallel.overlap_chunks=2 --set parallel.xla_scheduler=latency_hiding \
        --set "train.profile_steps=[7,8]" --run-dir "$RUNS/trace_on"
      read_trace "$RUNS/trace_on/profile" "$RUNS/trace_on"
      rm -rf "$RUNS/trace_on/checkpoints"
      ;;
    *) echo "PARTS: unknown part '$part' (exchange scaling)"; exit 2 ;;
  esac
done

mv "$OUT"/*.log "$OUT/steps.txt" "$RUNS/" 2>/dev/null
python3 scripts/gpu_summary.py "$RUNS" > "$RUNS/summary.txt" 2>&1
{ cat "$RUNS/env.txt"; echo; cat "$RUNS/steps.txt"; echo; cat "$RUNS/exchange_table.md" 2>/dev/null; echo
  cat "$RUNS/summary.txt"; echo; cat "$RUNS/trace_on.overlap.txt" 2>/dev/null; cat "$RUNS/trace_on.breakdown.md" 2>/dev/null
} > "$OUT/table.md"
pack issue29 "$RUNS"
cat "$OUT/table.md"
