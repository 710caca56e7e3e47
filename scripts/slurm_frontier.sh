#!/bin/bash
# xmoe_jax on Frontier (OLCF; 8 MI250X GCDs per node, Slingshot): one JAX process per GCD,
# RCCL over libfabric through the OFI network plugin. Submit from the repository root:
#
#   sbatch -A <PROJECT> -N 2 scripts/slurm_frontier.sh --config configs/small.yaml [xmoe-train args]
#   DRY_RUN=1 NODES=2 bash scripts/slurm_frontier.sh --config configs/small.yaml   # plan only
#
# Settings (environment, all optional):
#   XMOE_ENV      python environment holding ROCm JAX + xmoe_jax: a venv (has bin/activate) or a
#                 conda prefix (activated with the miniforge3 module); default: none (already active)
#   XMOE_MODULES  modules to load (default below: OLCF's JAX guide + the rccl-net-plugin module)
#   MODE          per-gcd (default: 8 tasks per node, --gpus-per-task=1 --gpu-bind=closest)
#                 or per-node (1 task per node seeing all 8 GCDs)
#   XMOE_RCCL_PLUGIN  path to a self-built librccl-net.so instead of the rccl-net-plugin module;
#                 then the Slingshot variables OLCF lists for a manual plugin are set here
#   XMOE_REQUIRE_OFI=1  make RCCL fail instead of silently falling back to TCP sockets (multi-node)
#   DRY_RUN=1     print the environment, the srun line and every task's launch plan; launch nothing
#   XMOE_RESUME=1 pass --resume: continue the run in train.run_dir, which must exist
#                  (a requeued job adds --resume-or-start by itself)
#
# Preemption (--signal, --requeue, --open-mode below): SIGTERM reaches every task 120 s before the
# time limit; the trainer saves, exits with status 75 and this script requeues the job, which
# resumes and appends to the same output file (scripts/slurm_requeue.sh, docs/reliability.md).
#
# Sources (OLCF user docs, docs.olcf.ornl.gov): "JAX" guide (modules rocm/7.2.0, cpe/26.03,
# jax-rocm7-pjrt/-plugin wheels), "PyTorch on Frontier" (srun -c7 --gpus-per-task=1
# --gpu-bind=closest, NCCL_SOCKET_IFNAME, MIOpen cache dirs, rccl-net-plugin module,
# --network=disable_rdzv_get with FI_CXI_RDZV_PROTO=alt_read, the manual-plugin variable list).
#
#SBATCH -J xmoe
#SBATCH -N 2
#SBATCH -t 01:00:00
#SBATCH -p batch
#SBATCH -o xmoe-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --network=disable_rdzv_get
set -euo pipefail

DRY_RUN=${DRY_RUN:-0}
MODE=${MODE:-per-gcd}
NODES=${SLURM_JOB_NUM_NODES:-${NODES:-2}}
GCDS_PER_NODE=8
PYTHON=${PYTHON:-python3}
XMOE_MODULES=${XMOE_MODULES-"PrgEnv-gnu/8.7.0 cpe/26.03 miniforge3/23.11.0-0 rocm/7.2.0 craype-accel-amd-gfx90a rccl-net-plugin"}

run() {  # run a setup command, or show it under DRY_RUN
  if [[ $DRY_RUN == 1 ]]; then echo "+ $*"; else "$@"; fi
}

# -- software: modules, then the python environment
if [[ -n $XMOE_MODULES ]]; then
  for m in $XMOE_MODULES; do run module load "$m"; done
  # OLCF: with a non-default cpe module, prefer its libraries
  export LD_LIBRARY_PATH=${CRAY_LD_LIBRARY_PATH:-}:${LD_LIBRARY_PATH:-}
fi
if [[ -n ${XMOE_ENV:-} ]]; then
  if [[ -f $XMOE_ENV/bin/activate ]]; then
    run source "$XMOE_ENV/bin/activate"
  else
    run source activate "$XMOE_ENV"  # conda prefix (miniforge3 module)
  fi
fi

# -- RCCL over Slingshot
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn0,hsn1,hsn2,hsn3}  # OLCF: try hsn0 alone on hangs
export FI_CXI_RDZV_PROTO=${FI_CXI_RDZV_PROTO:-alt_read}  # pairs with --network=disable_rdzv_get
if [[ -n ${XMOE_RCCL_PLUGIN:-} ]]; then  # OLCF's list for a self-built aws-ofi plugin
  export NCCL_NET_PLUGIN=$XMOE_RCCL_PLUGIN
  for kv in NCCL_CROSS_NIC=1 NCCL_NET_GDR_LEVEL=PHB HSA_FORCE_FINE_GRAIN_PCIE=1 \
    FI_MR_CACHE_MONITOR=kdreg2 FI_CXI_DISABLE_HOST_REGISTER=1 FI_CXI_DEFAULT_CQ_SIZE=131072 \
    FI_CXI_RDZV_EAGER_SIZE=0 FI_CXI_RDZV_THRESHOLD=0 FI_CXI_RDZV_GET_MIN=0 \
    FI_CXI_DEFAULT_TX_SIZE=2048 FI_CXI_RX_MATCH_MODE=hybrid; do
    name=${kv%%=*}
    [[ -n ${!name:-} ]] || export "$kv"  # values exported before sbatch win
  done
fi
if [[ ${XMOE_REQUIRE_OFI:-0} == 1 ]]; then  # OLCF: the plugin does not initialise on one node
  if ((NODES == 1)); then export NCCL_NET=Socket; else export NCCL_NET=OFI; fi
fi
# MIOpen's default cache on NFS home gives disk I/O errors (OLCF); use node-local /tmp
export MIOPEN_USER_DB_PATH=/tmp/miopen-cache-${SLURM_JOB_ID:-dry}
export MIOPEN_CUSTOM_CACHE_DIR=$MIOPEN_USER_DB_PATH

# -- launch: one process per GCD (default) or per node; xmoe_jax reads the rest from SLURM
if [[ $MODE == per-node ]]; then
  TASKS_PER_NODE=1
  SRUN=(srun -N "$NODES" --ntasks-per-node=1 -c 56 --gpus-per-task=$GCDS_PER_NODE --gpu-bind=closest)
elif [[ $MODE == per-gcd ]]; then
  TASKS_PER_NODE=$GCDS_PER_NODE
  SRUN=(srun -N "$NODES" -n $((NODES * GCDS_PER_NODE)) -c 7 --gpus-per-task=1 --gpu-bind=closest)
else
  echo "error: MODE=$MODE; use per-gcd or per-node" >&2
  exit 2
fi
CMD=("$PYTHON" -u -m xmoe_jax.cli "$@")
XMOE_SCRIPTS=${XMOE_SCRIPTS:-$(dirname "$0")}
[[ -f $XMOE_SCRIPTS/slurm_requeue.sh ]] || XMOE_SCRIPTS=${SLURM_SUBMIT_DIR:-.}/scripts # sbatch runs a copy
# shellcheck source=scripts/slurm_requeue.sh
source "$XMOE_SCRIPTS/slurm_requeue.sh" # requeue on status 75; --resume-or-start after a requeue
xmoe_resume_flag CMD

if [[ $DRY_RUN == 1 ]]; then
  echo "# environment"
  env | grep -E '^(NCCL_|FI_|HSA_|MIOPEN_|XLA_FLAGS|XMOE_)' | sort
  echo "# per node: srun --ntasks-per-node=1 mkdir -p $MIOPEN_USER_DB_PATH"
  echo "# launch: ${SRUN[*]} ${CMD[*]}"
  echo "# exit status $XMOE_PREEMPTED (saved on a signal): scontrol requeue \$SLURM_JOB_ID; the requeued job adds --resume-or-start"
  gpus=$([[ $MODE == per-node ]] && echo $GCDS_PER_NODE || echo 1)
  exec "$PYTHON" "$(dirname "$0")/launch_plan.py" --nodelist "${SLURM_JOB_NODELIST:-frontier[00001-$(printf %05d "$NODES")]}" \
    --tasks-per-node "$TASKS_PER_NODE" --gpus-per-task "$gpus"
fi
srun -N "$NODES" --ntasks-per-node=1 mkdir -p "$MIOPEN_USER_DB_PATH"
xmoe_run_and_requeue "${SRUN[@]}" -- "${CMD[@]}"
