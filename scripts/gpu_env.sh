# Sourced by the scripts/gpu_bench_*.sh drivers on a GPU machine (repo root): installs any wheels
# found in .whl/ (grain, jax-triton and their needs, for machines without them) into /tmp/site,
# puts them and the repo on PYTHONPATH, keeps NVLink multicast off, and creates $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}  # big models need more than the 75% default
