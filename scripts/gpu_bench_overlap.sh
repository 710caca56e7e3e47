#!/usr/bin/env bash
# GPU batch for the exchange overlapped with compute (issue 24: Build item 1, Run item 1; docs/exchange.md#overlap).
# Record the results in benchmarks/multigpu.md.
#
#   bash scripts/gpu_bench_overlap.sh ladder N   # weak scaling on 1, 2, 4, ... N GPUs (EP = GPUs), overlap off and on
#   bash scripts/gpu_bench_overlap.sh ways N     # on N GPUs: each way side by side, profile traces, kernel-overlap reports
#   DRY_RUN=1 OUT=/tmp/dry bash scripts/gpu_bench_overlap.sh ways 2   # tiny shapes, fake devices (CPU check: gpu_env.sh)
#
# The model: configs/tiny_small_shape.yaml (the Small shapes x 4 layers, dropless pft), 32 x 2048 = 64k
# tokens per GPU (the one-GPU run's: 197k tokens/s, MFU 41% on an H100; BATCH_PER_GPU changes it),
# train.batch_size = 32 x GPUs, mesh.expert = GPUs (data = 1), 30 steps, throughput of steps 21-30.
#   off: parallel.overlap=none, XLA's default scheduler;
#   on:  parallel.overlap=both with overlap_chunks=2 (pipelined chunks) and XLA's latency-hiding
#        scheduler (parallel.xla_scheduler=latency_hiding; the flag is set by XMOE_XLA_SCHEDULER before
#        JAX starts, and the JSON's overlap.xla_scheduler says whether it took effect).
# ways (at N GPUs, each traced over steps 12-14, outside the timed window): off; the scheduler alone;
# the chunks alone (default scheduler); on; and a twin with 2 shared experts (DeepSeek-style) without
# and with the shared experts inside the block (+ scheduler). For each, scripts/kernel_overlap.py
# writes $OUT/<name>.overlap.txt/json: per GPU, the NCCL kernel time and how much of it ran while a
# GEMM kernel ran ("CONCURRENT" or "serial"), and scripts/step_breakdown.py $OUT/<name>.breakdown.md/json.
# Traces stay under $OUT/<name>/profile (rm them if big).
# A run on fewer GPUs than the machine has uses CUDA_VISIBLE_DEVICES=0..n-1. Each run takes about
# 2 minutes (compile + 30 steps): under a 10-minute limit per command, split with SIZES="1 2" /
# SIZES="4 8" (ladder) and WAYS="off lhs chunks" / WAYS="on shared_off shared_on" (ways), same $OUT.
# Each step has its own timeout, a log and JSON under $OUT; the ladder table (tokens/s per GPU against
# 1 GPU, the goal >= 0.85) comes last.
set -u
source "$(dirname "$0")/gpu_env.sh"
CFG=configs/tiny_small_shape.yaml
PER_GPU=${BATCH_PER_GPU:-32}
OFF="--set parallel.overlap=none"
ON="--set parallel.overlap=both --set parallel.overlap_chunks=2 --set parallel.xla_scheduler=latency_hiding"

run() {  # name timeout gpus scheduler(default|latency_hiding) overrides...: one train step run on `gpus` GPUs
  local name=$1 limit=$2 n=$3 sched=$4; shift 4
  BATCH_PER_GPU=$PER_GPU XMOE_XLA_SCHEDULER=$sched ep_step "$name" "$limit" "$n" 30 $CFG "$@"
}
traced() {  # name timeout gpus scheduler overrides...: run() keeping a trace of steps 12-14, then its reports
  local name=$1; shift
  run "$name" "$@" --set "train.profile_steps=[12,14]" --run-dir "$OUT/$name"
  KEEP_TRACE=1 read_trace "$OUT/$name/profile" "$OUT/$name"
  echo "== $name"; cat "$OUT/$name.overlap.txt"
}
way() {  # name gpus: one way of `ways`, traced
  local n=$2 sh="--set model.moe.num_shared_experts=2"
  case "$1" in
    off) traced "ways_off_${n}gpu" 300 "$n" default $OFF ;;
    lhs) traced "ways_lhs_${n}gpu" 300 "$n" latency_hiding --set parallel.xla_scheduler=latency_hiding ;;
    chunks) traced "ways_chunks_${n}gpu" 300 "$n" default --set parallel.overlap=chunks --set parallel.overlap_chunks=2 ;;
    on) traced "ways_on_${n}gpu" 300 "$n" latency_hiding $ON ;;
    shared_off) traced "ways_shared_off_${n}gpu" 300 "$n" default $sh $OFF ;;
    shared_on) traced "ways_shared_on_${n}gpu" 300 "$n" latency_hiding $sh --set parallel.overlap=shared \
      --set parallel.xla_scheduler=latency_hiding ;;
    *) echo "unknown way $1 (off lhs chunks on shared_off shared_on)"; exit 2 ;;
  esac
}

N=${2:-}
[ -n "$N" ] || { echo "usage: $0 ladder|ways N"; exit 2; }
case "${1:-}" in
  ladder)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    sizes=${SIZES:-}
    if [ -z "$sizes" ]; then n=1; while [ "$n" -le "$N" ]; do sizes="$sizes $n"; n=$((n * 2)); done; fi
    for n in $sizes; do
      # shellcheck disable=SC2086
      run "ladder_off_${n}gpu" 300 "$n" default $OFF
      # shellcheck disable=SC2086
      run "ladder_on_${n}gpu" 300 "$n" latency_hiding $ON
    done
    summary
    python3 scripts/gpu_summary.py "$OUT" --ladder ;;
  ways)
    for w in ${WAYS:-off lhs chunks on shared_off shared_on}; do way "$w" "$N"; done
    summary ;;
  *) echo "usage: $0 ladder|ways N"; exit 2 ;;
esac
