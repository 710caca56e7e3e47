#!/usr/bin/env bash
# One process per GPU against one process for all (issue 30, Build item 4): the same config, mesh and
# seed, once as a single process driving N GPUs and once as N processes (one GPU each, explicit
# coordinator 127.0.0.1:<free port>, `python -m xmoe_jax.launch.local`), then tokens/s of both, their
# ratio (target: within 3%) and whether every step's loss is bitwise equal, and per process its exit
# status and how many log lines are shutdown noise (coordination-service warnings; target 0).
#
#   bash scripts/gpu_bench_procs.sh            # 4 GPUs: configs/tiny_small_shape.yaml, EP 4, 32 x 2048 per GPU
#   N=2 STEPS=10 bash scripts/gpu_bench_procs.sh
#   DRY_RUN=1 OUT=/tmp/dry N=2 STEPS=10 bash scripts/gpu_bench_procs.sh   # CPU check (scripts/gpu_env.sh):
#                                              # N processes x CPU_DEVICES (default 1) fake devices (gloo)
#
# The model: the Small shapes x 4 layers, dropless pft, mesh.expert = N (data 1), train.batch_size =
# 32 x N, data.shuffle=false (every layout reads the same sequences), STEPS steps (default 20; the
# JSON keeps every loss; tokens/s of the last third). Expect about 2 minutes per run on 4 H100s. Output
# under $OUT (7 files; the device tool brings back 8): single.json/.log, procs.json/.log (the launcher's
# lines), procs.tgz (each process's log), compare.txt, steps.txt (GPUs, each run's status and time).
set -u
source "$(dirname "$0")/gpu_env.sh"
N=${N:-4}
STEPS=${STEPS:-20}
CONFIG=${CONFIG:-configs/tiny_small_shape.yaml}
PER_GPU=${BATCH_PER_GPU:-32}
SETS=(--set mesh.expert="$N" --set mesh.data=1 --set train.batch_size=$((PER_GPU * N))
  --set parallel.dispatch=pft --set model.moe.capacity_factor=null --set data.shuffle=false)
# shellcheck disable=SC2206  # SHAPES is a list of --set overrides
BENCH=(python3 scripts/bench_train_step.py --config "$CONFIG" --steps "$STEPS"
  ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} "${SETS[@]}" ${SHAPES:-})
if [ "${JAX_PLATFORMS:-}" = cpu ]; then  # fake devices: N x CPU_DEVICES in all, the same for both runs
  per=${CPU_DEVICES:-1}
  SINGLE_ENV=(env XLA_FLAGS=--xla_force_host_platform_device_count=$((N * per)))
  MULTI_ENV=(env XLA_FLAGS=--xla_force_host_platform_device_count="$per")
  EACH=()
else
  SINGLE_ENV=(env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((N - 1)))")
  MULTI_ENV=(env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((N - 1)))")
  EACH=(--one-device-each)  # process I drives GPU I (--local-device-ids I)
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/steps.txt" 2>&1
step single 260 "${SINGLE_ENV[@]}" "${BENCH[@]}" --out "$OUT/single.json"
step procs 280 "${MULTI_ENV[@]}" python3 -m xmoe_jax.launch.local run -n "$N" "${EACH[@]}" --logs "$OUT/procs" \
  --grace 60 -- "${BENCH[@]}" --out "$OUT/procs.json"
cat "$OUT/procs.log"
if [ -f "$OUT/single.json" ] && [ -f "$OUT/procs.json" ]; then
  python3 -m xmoe_jax.launch.local compare "$OUT/single.json" "$OUT/procs.json" | tee "$OUT/compare.txt"
else
  echo "no comparison: a run wrote no JSON; its log ends:" | tee "$OUT/compare.txt"
  for f in single procs; do [ -f "$OUT/$f.json" ] || tail -5 "$OUT/$f.log"; done
fi
echo "== shutdown noise (coordination-service warnings, aborts) in the process logs:"
noise=$(grep -H -E "WatchTasksAsync|Connection refused|coordination service|Terminating process|jax.Client was leaked" \
  "$OUT"/procs/*.log | head -20)
echo "${noise:-none}"
pack procs "$OUT/procs"
cat "$OUT/steps.txt"
