# Sourced by the scripts/gpu_bench_*.sh drivers on a GPU machine (repo root): installs any wheels
# found in .whl/ (grain, tensorboardX, jax-triton and their needs, for machines without them) into /tmp/site,
# puts them and the repo on PYTHONPATH, keeps NVLink multicast off, creates $OUT, and defines the
# recipes a driver is a list of:
#   step NAME TIMEOUT COMMAND...               one step: its own timeout, log $OUT/NAME.log, rc and time in $OUT/steps.txt
#   train_step NAME TIMEOUT STEPS CONFIG ARGS  scripts/bench_train_step.py as a step, JSON in $JSON_DIR/NAME.json
#                                              ($JSON_DIR: default $OUT; $SHAPES: --set overrides added to every
#                                              train step; $MATMUL_SIZE: the same-run matmul ceiling's n, default 8192)
#   ep_step NAME TIMEOUT N STEPS CONFIG ARGS   train_step at expert parallel N on the first N GPUs: `ep_sets N`
#                                              (mesh.expert=N, mesh.data=1, train.batch_size = $BATCH_PER_GPU
#                                              (default 32) x N, dispatch pft), then ARGS (so they win)
#   gpus N|LIST                                the env assignment that shows a command the first N GPUs (or LIST:
#                                              2,3; one GPU: 2,): `env "$(gpus 2)" python3 ...`
#   env_record FILE                            the machine: GPUs, driver, commit, jax (and torch), date
#   read_trace PROFILE BASE [PNG]              a profile's reports: scripts/kernel_overlap.py -> BASE.overlap.json/.txt,
#                                              scripts/step_breakdown.py -> BASE.breakdown.json/.md (PNG: its plot);
#                                              then the trace (tens of MB) is removed (KEEP_TRACE=1 keeps it);
#                                              TRACE_HLO=FILE: the step's optimized HLO names what the trace does not
#   pack NAME DIR                              DIR into $OUT/NAME.tgz, DIR removed; over 15 MB (the device tool brings
#                                              back 16 MiB a file) its profile traces are left out
#   summary                                    the short table (scripts/gpu_summary.py) and steps.txt
# $TOKENS and $ITERS (default 16384 and 10): the MoE layer benchmarks' tokens per device and timed calls.
# DRY_RUN=1 is the CPU check of a batch (tests/test_gpu_batches.py, slow suite): JAX on the CPU with 4
# fake devices (DRY_DEVICES), $SHAPES tiny (hidden 64, 2 layers, sequences of 32 tokens) unless set,
# MATMUL_SIZE=256, TOKENS=64, ITERS=1, every step's time limit x DRY_SLOWDOWN (6), a missing nvidia-smi
# answers in one line, and gpus N fakes N CPU devices instead of choosing GPUs. Step counts stay the batch's own: what a config change breaks (a
# trace past the last step) shows here as on the GPU.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -n "${DRY_RUN:-}" ]; then
  export JAX_PLATFORMS=cpu MATMUL_SIZE=${MATMUL_SIZE:-256} TOKENS=${TOKENS:-64} ITERS=${ITERS:-1}
  # commands run on "all GPUs of the host" (4 in the batches' machines) see 4 fake devices
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${DRY_DEVICES:-4}"
  SHAPES=${SHAPES:-"--set model.hidden=64 --set model.num_heads=2 --set model.head_dim=32 --set model.num_layers=2
    --set model.scan_unroll=1 --set model.vocab_size=256 --set model.moe.expert_hidden=32 --set model.dense_hidden=128
    --set train.seq_len=32"}
  command -v nvidia-smi >/dev/null || nvidia-smi() { echo "nvidia-smi: none here (DRY_RUN on the CPU)"; }
fi
TOKENS=${TOKENS:-16384} ITERS=${ITERS:-10}  # the MoE layer benchmarks' tokens per device and timed calls
# A package missing from the machine and from .whl/ fails every step at its import: say so once, first.
python3 -c 'import xmoe_jax.train.loop, xmoe_jax.cli' > /tmp/xmoe_import_check.txt 2>&1 ||
  echo "gpu_env: xmoe_jax does not import here ($(tail -1 /tmp/xmoe_import_check.txt)); fill .whl/ with" \
    "scripts/peers_wheels.sh on a machine with internet and carry it" | tee -a "$OUT/steps.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1  # multicast off (KINDS.md)
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}  # big models need more than the 75% default
step() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  [ -z "${DRY_RUN:-}" ] || limit=$((limit * ${DRY_SLOWDOWN:-6}))  # CPU compiles, fake devices: slower
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}
train_step() {  # name timeout steps config overrides...
  local name=$1 limit=$2 steps=$3 config=$4; shift 4
  # shellcheck disable=SC2086  # SHAPES is a list of --set overrides
  step "$name" "$limit" python3 scripts/bench_train_step.py --config "$config" --steps "$steps" \
    --out "${JSON_DIR:-$OUT}/$name.json" ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} "$@" ${SHAPES:-}
}
gpus() {  # n, or a list (2,3; one GPU: 2,): CUDA_VISIBLE_DEVICES for those GPUs; under DRY_RUN as many fake CPU devices
  local list=$1
  [[ $list == *,* ]] || list=$(seq -s, 0 $(($1 - 1)))
  list=${list%,}
  if [ -n "${DRY_RUN:-}" ]; then
    local flags  # the batch-wide count out, this command's in
    flags=$(echo "${XLA_FLAGS:-}" | sed -E 's/ *--xla_force_host_platform_device_count=[0-9]+//g')
    echo "XLA_FLAGS=$flags --xla_force_host_platform_device_count=$(echo "$list" | tr ',' '\n' | wc -l)"
  else
    echo "CUDA_VISIBLE_DEVICES=$list"
  fi
}
ep_sets() {  # n: the --set overrides of expert parallel n (ep_step's; bench_peers.sh's xmoe_epN rows)
  echo "--set mesh.expert=$1 --set mesh.data=1 --set train.batch_size=$((${BATCH_PER_GPU:-32} * $1))" \
    "--set parallel.dispatch=pft"
}
ep_step() {  # name timeout n steps config overrides...: EP n on the first n GPUs
  local name=$1 limit=$2 n=$3 steps=$4 config=$5; shift 5
  # a function's environment prefix reaches the commands it runs (XMOE_XLA_SCHEDULER=... ep_step ...)
  local -x "$(gpus "$n")"
  # shellcheck disable=SC2046  # ep_sets is a list of --set overrides
  train_step "$name" "$limit" "$steps" "$config" $(ep_sets "$n") "$@"
}
env_record() {  # file: the machine a batch ran on
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    git log -1 --format='commit %H %cs' 2>/dev/null && git status --short 2>/dev/null | head -20
    python3 -c 'import jax; print("jax", jax.__version__)'
    python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null
    date -u; } > "$1" 2>&1
}
read_trace() {  # profile base [png]: the trace's overlap and breakdown reports, then the trace goes
  local profile=$1 base=$2 png=${3:-}
  [ -d "$profile" ] || return 0
  python3 scripts/kernel_overlap.py "$profile" --out "$base.overlap.json" > "$base.overlap.txt" 2>&1
  python3 scripts/step_breakdown.py "$profile" --steps 2 --out "$base.breakdown.json" ${png:+--plot "$png"} \
    ${TRACE_HLO:+--hlo "$TRACE_HLO"} > "$base.breakdown.md" 2>&1
  [ -n "${KEEP_TRACE:-}" ] || rm -rf "$profile"
}
pack() {  # name dir: $OUT/name.tgz holds dir (under its own name); dir removed
  local name=$1 dir=$2
  tar -czf "$OUT/$name.tgz" -C "$(dirname "$dir")" "$(basename "$dir")" || return
  if [ "$(stat -c %s "$OUT/$name.tgz")" -ge 15000000 ]; then
    find "$dir" -type d -name profile -prune -exec rm -rf {} +
    tar -czf "$OUT/$name.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
  fi
  rm -rf "$dir"
}
summary() {  # the short table: one line per JSON under $OUT, then the steps' rc and times
  python3 scripts/gpu_summary.py "$OUT"
  cat "$OUT/steps.txt"
}
