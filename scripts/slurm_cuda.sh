#!/bin/bash
# xmoe_jax on a generic SLURM + NVIDIA GPU cluster: one JAX process per GPU (default) or per
# node, NCCL for collectives. Submit from the repository root:
#
#   sbatch -N 2 --gpus-per-node=8 scripts/slurm_cuda.sh --config configs/small.yaml [xmoe-train args]
#   DRY_RUN=1 NODES=2 GPUS_PER_NODE=8 bash scripts/slurm_cuda.sh --config configs/small.yaml   # plan only
#
# Settings (environment, all optional):
#   XMOE_ENV       a venv holding jax[cuda13] + xmoe_jax (has bin/activate); default: already active
#   XMOE_MODULES   modules to load first (site specific; default: none)
#   GPUS_PER_NODE  default: SLURM_GPUS_ON_NODE, else 8
#   MODE           per-gpu (default: --gpus-per-task=1, srun binds one GPU per task) or per-node
#                  (one task per node seeing all its GPUs)
#   NCCL_SOCKET_IFNAME / NCCL_IB_HCA / ...  site network settings, passed through unchanged
#   DRY_RUN=1      print the environment, the srun line and every task's launch plan; launch nothing
#   XMOE_RESUME=1  pass --resume: continue the run in train.run_dir, which must exist
#                   (a requeued job adds --resume-or-start by itself)
#
# Preemption (--signal, --requeue, --open-mode below): SIGTERM reaches every task 120 s before the
# time limit; the trainer saves, exits with status 75 and this script requeues the job, which
# resumes and appends to the same output file (scripts/slurm_requeue.sh, docs/reliability.md).
#
#SBATCH -J xmoe
#SBATCH -N 2
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH -t 01:00:00
#SBATCH -o xmoe-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=TERM@120
#SBATCH --requeue
set -euo pipefail

DRY_RUN=${DRY_RUN:-0}
MODE=${MODE:-per-gpu}
NODES=${SLURM_JOB_NUM_NODES:-${NODES:-2}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
PYTHON=${PYTHON:-python3}

run() {  # run a setup command, or show it under DRY_RUN
  if [[ $DRY_RUN == 1 ]]; then echo "+ $*"; else "$@"; fi
}

for m in ${XMOE_MODULES:-}; do run module load "$m"; done
if [[ -n ${XMOE_ENV:-} ]]; then run source "$XMOE_ENV/bin/activate"; fi
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

if [[ $MODE == per-node ]]; then
  TASKS_PER_NODE=1
  SRUN=(srun -N "$NODES" --ntasks-per-node=1 --gpus-per-node="$GPUS_PER_NODE")
  PLAN=(--tasks-per-node 1 --gpus-per-node "$GPUS_PER_NODE")
elif [[ $MODE == per-gpu ]]; then
  TASKS_PER_NODE=$GPUS_PER_NODE
  SRUN=(srun -N "$NODES" --ntasks-per-node="$GPUS_PER_NODE" --gpus-per-task=1)
  PLAN=(--tasks-per-node "$GPUS_PER_NODE" --gpus-per-task 1)
else
  echo "error: MODE=$MODE; use per-gpu or per-node" >&2
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
  env | grep -E '^(NCCL_|XLA_FLAGS|XMOE_|CUDA_VISIBLE_DEVICES)' | sort
  echo "# launch ($TASKS_PER_NODE task(s) per node): ${SRUN[*]} ${CMD[*]}"
  echo "# exit status $XMOE_PREEMPTED (saved on a signal): scontrol requeue \$SLURM_JOB_ID; the requeued job adds --resume-or-start"
  exec "$PYTHON" "$(dirname "$0")/launch_plan.py" --nodelist "${SLURM_JOB_NODELIST:-gpu[001-$(printf %03d "$NODES")]}" "${PLAN[@]}"
fi
xmoe_run_and_requeue "${SRUN[@]}" -- "${CMD[@]}"
