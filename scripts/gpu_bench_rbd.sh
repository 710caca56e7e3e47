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
# Each part has its own time limit, so a slow or hung part cannot take the others' results with it.
# Everything lands in ${OUT:-/tmp/out}/results_<part>.tgz (JSON + logs) and a summary on stdout.
# Needs grain/jax-triton wheels in .whl (benchmarks/README.md, "Running").
set -u
source scripts/gpu_env.sh
R=/tmp/results; mkdir -p "$R"
nvidia-smi topo -m > "$R/topo.txt" 2>&1
# train NAME LIMIT_S DISPATCH CAPACITY_FACTOR [--set ...]: a 24-step Small-shaped (2 layers) run on 2 nodes x 2
train() {
  local name=$1 limit=$2 dispatch=$3 cf=$4; shift 4
  timeout "$limit" python3 scripts/bench_train_step.py --config configs/tiny_small_shape.yaml \
    --set mesh.data=1 --set mesh.expert=4 --set mesh.expert_nodes=2 --set model.num_layers=2 \
    --set train.batch_size=32 --set parallel.dispatch="$dispatch" --set model.moe.capacity_factor="$cf" "$@" \
    --steps 24 --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "== $name"; grep -E '"(tokens_per_s|mfu_vs_datasheet|tflops_per_device|final_loss)"|Error|overflow' \
    "$R/$name.log" | tail -6
}
LAYER="scripts/bench_moe_layer.py --tokens-per-device 16384 --modes rbd,pft,padded:1.25 --stages pft,rbd --skews 0,1.0 --iters 10"

case "${1:-layers}" in
  layers)
    CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 $LAYER --expert-nodes 2 --no-exchange \
      --out "$R/layer_2nodes_x1.json" > "$R/layer_2nodes_x1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=2,3 timeout 300 python3 scripts/compare_sharding.py --config configs/small.yaml \
      --set mesh.expert=1 --set mesh.tensor=2 --tokens 16384 --model-layers 2 \
      --out "$R/compare_sharding_2xh200.json" > "$R/compare_sharding_2xh200.log" 2>&1 &
    wait
    timeout 230 python3 $LAYER --expert-nodes 2 --out "$R/layer_2nodes_x2.json" > "$R/layer_2nodes_x2.log" 2>&1
    for f in layer_2nodes_x1 compare_sharding_2xh200 layer_2nodes_x2; do
      echo "== $f"; grep -v '^{' "$R/$f.log" | tail -22
    done ;;
  train)
    for mode in padded:1.25 pft:null rbd:null; do
      train "train_2nodes_x2_${mode%%:*}" 170 "${mode%%:*}" "${mode#*:}"
    done ;;
  exchange)
    for t in auto emulated; do for f in none 1.25; do
      rbf=$([ $f = none ] || echo "--recv-buffer-factor $f")
      timeout 110 python3 scripts/bench_moe_layer.py --tokens-per-device 16384 --modes rbd,pft --skews 0 \
        --expert-nodes 2 --no-exchange --transport $t $rbf $([ $f = none ] && echo "--stages pft,rbd") \
        --out "$R/layer_2nodes_x2_${t}_rbf$f.json" > "$R/layer_2nodes_x2_${t}_rbf$f.log" 2>&1
      echo "== transport $t recv_buffer_factor $f"; grep -v '^{' "$R/layer_2nodes_x2_${t}_rbf$f.log" | tail -8
    done; done
    for name in pft rbd; do
      train "train_2nodes_x2_${name}_emulated" 100 $name null --set parallel.transport=emulated
    done ;;
  buffer)
    for layout in x2 x1; do
      gpus=$([ $layout = x2 ] && echo 0,1,2,3 || echo 0,1)
      CUDA_VISIBLE_DEVICES=$gpus timeout 120 python3 scripts/bench_moe_layer.py --tokens-per-device 16384 \
        --modes rbd,pft --skews 0 --expert-nodes 2 --no-exchange --recv-buffer-factor 1.25 --stages pft,rbd \
        --out "$R/layer_2nodes_${layout}_rbf1.25.json" > "$R/layer_2nodes_${layout}_rbf1.25.log" 2>&1
      echo "== 2 nodes $layout, recv_buffer_factor 1.25"; grep -v '^{' "$R/layer_2nodes_${layout}_rbf1.25.log" | tail -7
    done
    for name in pft rbd; do
      train "train_2nodes_x2_${name}_rbf1.25" 100 $name null --set parallel.recv_buffer_factor=1.25
    done ;;
  rerun)
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 $LAYER --modes pft,padded:1.25 --stages pft \
      --out "$R/layer_1gpu.json" > "$R/layer_1gpu.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=2,3 timeout 200 python3 $LAYER --expert-nodes 2 --no-exchange \
      --out "$R/layer_2nodes_x1.json" > "$R/layer_2nodes_x1.log" 2>&1 &
    wait
    timeout 150 python3 $LAYER --expert-nodes 2 --skews 0 --no-exchange --recv-buffer-factor 1.25 \
      --out "$R/layer_2nodes_x2_rbf1.25.json" > "$R/layer_2nodes_x2_rbf1.25.log" 2>&1
    for f in layer_1gpu layer_2nodes_x1 layer_2nodes_x2_rbf1.25; do
      echo "== $f"; grep -v '^{' "$R/$f.log" | tail -14
    done
    for mode in padded:1.25 pft:null rbd:null; do
      name=${mode%%:*}; rbf=$([ $name = padded ] && echo null || echo 1.25)
      train "train_2nodes_x2_$name" 100 $name "${mode#*:}" --set parallel.recv_buffer_factor=$rbf
    done ;;
  backward)
    B="scripts/bench_moe_layer.py --tokens-per-device 16384 --skews 0 --no-exchange --stages-backward"
    timeout 230 python3 $B --modes rbd --stages pft,rbd --expert-nodes 2 --recv-buffer-factor 1.25 \
      --out "$R/stages_bwd_2nodes_x2_rbf1.25.json" > "$R/stages_bwd_2nodes_x2_rbf1.25.log" 2>&1
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 $B --modes rbd --stages pft,rbd --expert-nodes 2 \
      --out "$R/stages_bwd_2nodes_x1.json" > "$R/stages_bwd_2nodes_x1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=2 timeout 150 python3 $B --modes pft --stages pft \
      --out "$R/stages_bwd_1gpu.json" > "$R/stages_bwd_1gpu.log" 2>&1 &
    wait
    for f in stages_bwd_2nodes_x2_rbf1.25 stages_bwd_2nodes_x1 stages_bwd_1gpu; do
      echo "== $f"; grep -E '^ *0.0 |^stages|Error' "$R/$f.log"
    done ;;
esac
tar czf "$OUT/results_${1:-layers}.tgz" -C "$R" .
