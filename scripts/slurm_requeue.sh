# Sourced by scripts/slurm_*.sh: run the training step, and requeue the job when the trainer stopped
# on a signal after saving (exit status 75, EX_TEMPFAIL; docs/reliability.md).
#
#   xmoe_resume_flag CMD_ARRAY_NAME     appends --resume-or-start to the command after a requeue
#                                       (SLURM_RESTART_COUNT > 0: the first run may have died before
#                                       it wrote anything), --resume when XMOE_RESUME=1 (continue a
#                                       run that must exist: a typo in train.run_dir is refused)
#   xmoe_run_and_requeue SRUN... -- CMD...
#                                       runs srun in the background, passes SIGTERM / SIGUSR1 that
#                                       reach the batch shell on to it (scancel, --signal=B:...),
#                                       waits, requeues on status 75, and exits with srun's status
#
# The scripts ask SLURM for `--signal=TERM@120`: every task gets SIGTERM 120 s before the time
# limit, finishes its step, saves and exits 75 (raise the lead time for large models: the step in
# flight plus one synchronous save must fit). `--requeue` lets the job be requeued and
# `--open-mode=append` keeps one output file across requeues.
XMOE_PREEMPTED=75

xmoe_resume_flag() {
  local -n cmd=$1
  if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
    cmd+=(--resume-or-start)
  elif [[ ${XMOE_RESUME:-0} == 1 ]]; then
    cmd+=(--resume)
  fi
}

xmoe_run_and_requeue() {
  local srun=() status=0 rc pid interrupted
  while [[ $1 != -- ]]; do srun+=("$1"); shift; done
  shift
  "${srun[@]}" "$@" &
  pid=$!
  trap 'interrupted=1; kill -TERM "$pid" 2>/dev/null || true' TERM
  trap 'interrupted=1; kill -USR1 "$pid" 2>/dev/null || true' USR1
  while :; do # a trapped signal interrupts `wait`: wait again for srun's own status
    interrupted=0
    wait "$pid" && rc=0 || rc=$?
    [[ $rc == 127 ]] && break # already reaped: keep the status we have
    status=$rc
    [[ $interrupted == 1 ]] || break
  done
  trap - TERM USR1
  if [[ $status == "$XMOE_PREEMPTED" && -n ${SLURM_JOB_ID:-} ]]; then
    echo "xmoe: the trainer saved and stopped on a signal (status $status); requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
