#!/usr/bin/env bash
# GPU probe, one GPU: where the train step's device copies (MemcpyD2D: 6.8k launches, 9% of the
# full-depth Small step on 4x H200, benchmarks/depth.md) come from, and what a config or XLA flag
# does to them. From the repo root, wheels in .whl/:
#
#   bash scripts/gpu_probe_copies.sh        # about 4 minutes on one H100
#
# The Small's layer shapes x 4 layers on one GPU, 4 micro-batches of 16k tokens, remat=save_exchange
# (the depth run's step without the exchange), 12 steps, steps 9-10 profiled and read by
# scripts/step_breakdown.py ("Device copies by source": HLO op @ JAX name stack). Variants:
#   scan       the layers as a scan (the default)
#   unrolled   model.unroll_layers=true (static slices instead of the scan's dynamic ones)
#   dsfusion   XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true (GEMMs read the slice in place)
set -u
source "$(dirname "$0")/gpu_env.sh"
# no CUDA graphs: their kernels carry only the graph's name stack (docs/profiling.md)
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
SHAPES="--set model.num_layers=4 --set mesh.expert=1 --set mesh.data=1 --set train.batch_size=32
  --set train.micro_batch_size=8 --set model.remat=save_exchange --set train.tensorboard=false"
probe() {  # name overrides...: one run, its breakdown beside its JSON
  local name=$1; shift
  train_step "$name" 240 12 configs/small.yaml --run-dir "$OUT/runs/$name" --set "train.profile_steps=[9,10]" "$@"
  read_trace "$OUT/runs/$name/profile" "$OUT/$name"
  rm -rf "$OUT/runs/$name"
}
probe scan
probe unrolled --set model.unroll_layers=true
XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_dynamic_slice_fusion=true" probe dsfusion
mkdir -p "$OUT/logs" && mv "$OUT"/*.log "$OUT/logs/" 2>/dev/null
tar -czf "$OUT/probe.tgz" -C "$OUT" logs $(cd "$OUT" && ls ./*.json ./*.md 2>/dev/null) && rm -rf "$OUT/logs"
summary
for f in "$OUT"/*.breakdown.md; do echo "== $f"; sed -n '/^| category/,/^$/p;/Device copies/,/^Note/p' "$f"; done
