#!/usr/bin/env bash
# The GPU runs of benchmarks/rbd.md, four_gpu.md and compare_sharding_gpu.md on one 4-GPU host,
# in one device call. Usage (repo root, GPU machine):
#   bash scripts/gpu_bench_rbd.sh layers   # MoE layer, pft/rbd/padded + per-stage times:
#                                          #   GPUs 0,1 as 2 single-GPU nodes, alongside compare_sharding.py
#                                          #   (TP=2) on GPUs 2,3; then all 4 GPUs as 2 nodes x 2
#   bash scripts/gpu_bench_rbd.sh train    # short train runs on 2 nodes x 2 for padded, pft, rbd
#   bash scripts/gpu_bench_rbd.sh exchange # 2 nodes x 2, uniform: pft/rbd under each transport and receive
#                                          #   buffer, then pft/rbd training with the emulated transport
#   bash scripts/gpu_bench_rbd.sh buffer   # recv_buffer_factor 1.25 (uniform): layer + stages on 2 nodes x 2
#                                          #   and 2 nodes x 1, then pft/rbd training on 2 nodes x 2
#   bash scripts/gpu_bench_rbd.sh rerun    # after a dispatch change: 1 GPU (pft vs padded) beside 2 nodes x 1,
#                                          #   then 2 nodes x 2 with recv_buffer_factor 1.25, then training
#   bash scripts/gpu_bench_rbd.sh backward # forward+backward per stage, uniform: 2 nodes x 2 (recv_buffer_factor
#                                          #   1.25), then 2 nodes x 1 (worst-case buffer) beside 1 GPU
#   DRY_RUN=1 OUT=/tmp/dry bash scripts/gpu_bench_rbd.sh train   # a part's CPU check (scripts/gpu_env.sh)
# Each run is a step with its own time limit, so a slow or hung run cannot take the others' results with it.
# Everything lands in ${OUT:-/tmp/out}/results_<part>.tgz (JSON + logs + steps.txt) and a summary on stdout.
# Needs grain/jax-triton wheels in .whl (benchmarks/README.md, "Running").
set -u
source scripts/gpu_env.sh
PART=${1:-layers}
R=$OUT/results_$PART; mkdir -p "$R"
nvidia-smi topo -m > "$R/topo.txt" 2>&1
# train NAME LIMIT_S DISPATCH CAPACITY_FACTOR [--set ...]: a 24-step Small-shaped (2 layers) run on 2 nodes x 2
train() {
  local name=$1 limit=$2 dispatch=$3 cf=$4; shift 4
  JSON_DIR=$R BATCH_PER_GPU=8 ep_step "$name" "$limit" 4 24 configs/tiny_small_shape.yaml \
    --set mesh.expert_nodes=2 --set model.num_layers=2 --set parallel.dispatch="$dispatch" \
    --set model.moe.capacity_factor="$cf" "$@"
  echo "== $name"; grep -E '"(tokens_per_s|mfu_vs_datasheet|tflops_per_device|final_loss)"|Error|overflow' \
    "$OUT/$name.log" | tail -6
}
layer() {  # name limit gpus args...: scripts/bench_moe_layer.py on those GPUs, JSON under $R
  local name=$1 limit=$2 on=$3; shift 3
  step "$name" "$limit" env "$(gpus "$on")" python3 scripts/bench_moe_layer.py --tokens-per-device "$TOKENS" \
    --iters "$ITERS" "$@" --out "$R/$name.json"
}
LAYER=(--modes rbd,pft,padded:1.25 --stages pft,rbd --skews 0,1.0)

case "$PART" in
  layers)
    layer layer_2nodes_x1 300 0,1 "${LAYER[@]}" --expert-nodes 2 --no-exchange &
    step compare_sharding_2xh200 300 env "$(gpus 2,3)" python3 scripts/compare_sharding.py --config configs/small.yaml \
      --set mesh.expert=1 --set mesh.tensor=2 --tokens "$TOKENS" --model-layers 2 \
      --out "$R/compare_sharding_2xh200.json" &
    wait
    layer layer_2nodes_x2 230 4 "${LAYER[@]}" --expert-nodes 2
    for f in layer_2nodes_x1 compare_sharding_2xh200 layer_2nodes_x2; do
      echo "== $f"; grep -v '^{' "$OUT/$f.log" | tail -22
    done ;;
  train)
    for mode in padded:1.25 pft:null rbd:null; do
      train "train_2nodes_x2_${mode%%:*}" 170 "${mode%%:*}" "${mode#*:}"
    done ;;
  exchange)
    for t in auto emulated; do for f in none 1.25; do
      rbf=$([ $f = none ] || echo "--recv-buffer-factor $f")
      # shellcheck disable=SC2046,SC2086
      layer "layer_2nodes_x2_${t}_rbf$f" 110 4 --modes rbd,pft --skews 0 --expert-nodes 2 --no-exchange \
        --transport $t $rbf $([ $f = none ] && echo "--stages pft,rbd")
      echo "== transport $t recv_buffer_factor $f"; grep -v '^{' "$OUT/layer_2nodes_x2_${t}_rbf$f.log" | tail -8
    done; done
    for name in pft rbd; do
      train "train_2nodes_x2_${name}_emulated" 100 $name null --set parallel.transport=emulated
    done ;;
  buffer)
    for layout in x2 x1; do
      gpus=$([ $layout = x2 ] && echo 0,1,2,3 || echo 0,1)
      layer "layer_2nodes_${layout}_rbf1.25" 120 "$gpus" --modes rbd,pft --skews 0 --expert-nodes 2 --no-exchange \
        --recv-buffer-factor 1.25 --stages pft,rbd
      echo "== 2 nodes $layout, recv_buffer_factor 1.25"; grep -v '^{' "$OUT/layer_2nodes_${layout}_rbf1.25.log" | tail -7
    done
    for name in pft rbd; do
      train "train_2nodes_x2_${name}_rbf1.25" 100 $name null --set parallel.recv_buffer_factor=1.25
    done ;;
  rerun)
    layer layer_1gpu 200 1 "${LAYER[@]}" --modes pft,padded:1.25 --stages pft &
    layer layer_2nodes_x1 200 2,3 "${LAYER[@]}" --expert-nodes 2 --no-exchange &
    wait
    layer layer_2nodes_x2_rbf1.25 150 4 "${LAYER[@]}" --expert-nodes 2 --skews 0 --no-exchange --recv-buffer-factor 1.25
    for f in layer_1gpu layer_2nodes_x1 layer_2nodes_x2_rbf1.25; do
      echo "== $f"; grep -v '^{' "$OUT/$f.log" | tail -14
    done
    for mode in padded:1.25 pft:null rbd:null; do
      name=${mode%%:*}; rbf=$([ $name = padded ] && echo null || echo 1.25)
      train "train_2nodes_x2_$name" 100 $name "${mode#*:}" --set parallel.recv_buffer_factor=$rbf
    done ;;
  backward)
    B=(--skews 0 --no-exchange --stages-backward)
    layer stages_bwd_2nodes_x2_rbf1.25 230 4 "${B[@]}" --modes rbd --stages pft,rbd --expert-nodes 2 \
      --recv-buffer-factor 1.25
    layer stages_bwd_2nodes_x1 150 0,1 "${B[@]}" --modes rbd --stages pft,rbd --expert-nodes 2 &
    layer stages_bwd_1gpu 150 2, "${B[@]}" --modes pft --stages pft &
    wait
    for f in stages_bwd_2nodes_x2_rbf1.25 stages_bwd_2nodes_x1 stages_bwd_1gpu; do
      echo "== $f"; grep -E '^ *0.0 |^stages|Error' "$OUT/$f.log"
    done ;;
esac
mv "$OUT"/*.log "$OUT/steps.txt" "$R/" 2>/dev/null
pack "results_$PART" "$R"
