# Sourced by the scripts/gpu_bench_*.sh drivers on a GPU machine (repo root): installs any wheels
# found in .whl/ (grain, tensorboardX, jax-triton and their needs, for machines without them) into /tmp/site,
# puts them and the repo on PYTHONPATH, keeps NVLink multicast off, creates $OUT, and defines
#   step NAME TIMEOUT COMMAND...               one step: its own timeout, log $OUT/NAME.log, rc and time in $OUT/steps.txt
#   train_step NAME TIMEOUT STEPS CONFIG ARGS  scripts/bench_train_step.py as a step, JSON in $OUT/NAME.json
#                                              ($SHAPES: --set overrides added to every train step;
#                                              $MATMUL_SIZE: the same-run matmul ceiling's n, default 8192)
#   summary                                    the short table (scripts/gpu_summary.py) and steps.txt
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# A package missing from the machine and from .whl/ fails every step at its import: say so once, first.
python3 -c 'import xmoe_jax.train.loop, xmoe_jax.cli' > /tmp/xmoe_import_check.txt 2>&1 ||
  echo "gpu_env: xmoe_jax does not import here ($(tail -1 /tmp/xmoe_import_check.txt)); fill .whl/ with" \
    "scripts/peers_wheels.sh on a machine with internet and carry it" | tee -a "$OUT/steps.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1  # multicast off (KINDS.md)
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}  # big models need more than the 75% default
step() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}
train_step() {  # name timeout steps config overrides...
  local name=$1 limit=$2 steps=$3 config=$4; shift 4
  # shellcheck disable=SC2086  # SHAPES is a list of --set overrides
  step "$name" "$limit" python3 scripts/bench_train_step.py --config "$config" --steps "$steps" \
    --out "$OUT/$name.json" ${MATMUL_SIZE:+--matmul-size "$MATMUL_SIZE"} "$@" ${SHAPES:-}
}
summary() {  # the short table: one line per JSON under $OUT, then the steps' rc and times
  python3 scripts/gpu_summary.py "$OUT"
  cat "$OUT/steps.txt"
}
