#!/usr/bin/env bash
# GPU batch for the push exchange kernel (issue 36; benchmarks/exchange.md). On one host of N GPUs
# (2 to develop, 4 to measure), from the repo root, wheels in .whl/ (scripts/peers_wheels.sh):
#
#   bash scripts/gpu_bench_push.sh                 # about 4 minutes on 2 or 4 GPUs
#
#   PARTS="scaling" bash scripts/gpu_bench_push.sh # the train step only (about 7 minutes on 4 GPUs)
#
# Part `exchange` (default PARTS="exchange scaling"): a small correctness-first run of the Mosaic kernel alone (checked bit for bit against NumPy,
# 60 s limit, so a hang costs a minute); then scripts/bench_exchange.py at 16,384 rows x 2048 bf16 per
# pair, uniform / hot pair / hot receiver: JAX's dense all_to_all, our `exact` (512 updates per peer),
# push at $PUSH (CTAs[xUPDATES per peer]), and NCCL's all_to_all_single through torch, one table.
# Part `scaling`: weak scaling of the Small shapes x 4 layers (configs/tiny_small_shape.yaml) at 64k tokens
# per GPU, $STEPS steps: 1 GPU, then N GPUs (EP N) with `bucketed` and with `push`; every step's loss in
# the JSON (push and bucketed must train alike).
# Parts `depth_push`, `depth_bucketed` (each about 5 minutes: one per call): the paper's Small at 28 layers,
# EP N, 4 micro-batches of 16k tokens per GPU, save_exchange, learned router, $DEPTH_STEPS steps (60),
# logged every 10 (the windows show what buffer changes and their recompiles cost).
# Parts `depth_shrink`, `depth_tgmm` (each about 5 minutes): push at depth as `depth_push`, with one lever each:
# buffers that shrink after 20 quiet steps (parallel.buffer_shrink_after=20), or tgmm reading its indexed rows in its
# kernel (XMOE_TGMM_GATHER=kernel) instead of XLA gathering the whole receive buffer first.
# Part `depth_stacks` (about 5 minutes): push at depth with the scan's residual stacks started uninitialised
# (XMOE_SCAN_STACKS=empty, xmoe_jax/launch/scan_stacks.py) instead of zero-filled; its losses must equal depth_push's.
# Part `depth_source` (about 5 minutes): push at depth with its rows landing source-major (XMOE_ARRIVAL=source) instead
# of grouped by expert (layouts.compact), for measuring expert-major arrival; its losses must equal depth_push's.
# Part `depth_unfused` (about 5 minutes): push at depth with the return exchange after the down-projection
# (XMOE_FUSED_RETURN=off) instead of inside its kernel (kernels/push: gmm_push); its losses must equal depth_push's.
# Part `depth_sized` (DEPTH_STEPS=200 in about 9 minutes: one call): push at depth with its one receive buffer sized
# once at the factor a learned router reaches within 15 steps (parallel.recv_buffer_factor=$SIZED_FACTOR, 2.5) instead
# of grown to it from 1.2 (three recompiles, each rerunning a step); for the whole run against its last window.
# Part `depth_arrive` (about 5 minutes): push at depth with the exchanges that bring rows (the dispatch, the
# backward's cotangent) inside the GEMM after them too (XMOE_FUSED_ARRIVE=on, kernels/push: push_gmm); its losses
# must equal depth_push's. Part `arrive` (about 4 minutes): scripts/bench_gmm_push.py --passes up,ddown, that
# kernel against the push kernel and then the GEMM (checked bit for bit first; a hang stops at ARRIVE_LIMIT, 240 s).
# Part `gmm_push` (about 4 minutes): scripts/bench_gmm_push.py, the down-projection and the up-projection's data
# gradient with the exchange back inside, against the GEMM and then the push kernel (checked bit for bit against each
# other first); GMM_PUSH_ARGS=--tiny on a CPU.
# DEPTH_LAYERS=12 runs the depth parts at 12 layers (2 GPUs hold that, not 28), DEPTH_LIMIT their time limit (560 s).
# Part `depth_mem` (about 4 minutes): why the 28-layer push step runs out of memory where bucketed fits.
# xmoe-plan --real-devices compiles the depth step for push and bucketed (XLA's own temporaries, and
# its memory-usage report kept from an HLO dump); then the push run for 3 steps with the allocator's
# chunk map logged on failure (TF_CPP_MIN_LOG_LEVEL=0), and again on CUDA's async allocator.
# Part `overlap` (about 1 minute): scripts/bench_push_overlap.py, the push kernel beside an independent GEMM on
# one stream and with the kernel annotated to XLA's stream 1, under XLA's default scheduler and the latency-hiding one.
# CPU dry run (tests/test_gpu_batches.py; push runs its XLA reference there, the torch row fails):
#   DRY_RUN=1 ROWS=64 CHECK_ROWS=16 PUSH=4,4x3 bash scripts/gpu_bench_push.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
N=${N:-$(python3 -c 'import jax; print(jax.device_count())' 2>/dev/null || echo 2)}
PUSH=${PUSH:-32,64,128,64x16}
ROWS=${ROWS:-16384}
env_record "$OUT/env.txt"
run_exchange() {
  # one kernel per call where a scan stacks the rows (XLA's dynamic-slice fusion cloned it: docs/profiling.md)
  step push_once 120 python3 -m pytest -q -p no:cacheprovider tests/test_push.py -k once_per_call
  step push_quick 60 python3 scripts/bench_exchange.py jax --rows "${QUICK_ROWS:-1024}" --check-rows "${CHECK_ROWS:-512}" --updates "" \
    --push 32 --out "$OUT/push_quick.json"
  step ex_jax 240 python3 scripts/bench_exchange.py jax --rows "$ROWS" --check-rows "${CHECK_ROWS:-512}" --updates 512 \
    --push "$PUSH" --out "$OUT/ex_jax.json"
  step ex_torch 120 python3 -m torch.distributed.run --nproc_per_node "$N" scripts/bench_exchange.py torch \
    --rows "$ROWS" --out "$OUT/ex_torch.json"
  python3 scripts/bench_exchange.py table "$OUT"/ex_*.json > "$OUT/table.md" 2>&1
}
for part in ${PARTS:-exchange scaling}; do
  case $part in
    exchange) run_exchange ;;
    scaling)
      ep_step ws_1gpu 150 1 "${STEPS:-15}" configs/tiny_small_shape.yaml --log-every 5 --set train.tensorboard=false
      for transport in bucketed push; do
        ep_step "ws_$transport" 170 "$N" "${STEPS:-15}" configs/tiny_small_shape.yaml --log-every 5 \
          --set train.tensorboard=false --set parallel.transport=$transport
      done ;;
    gmm_push)  # the down-projection with the return exchange inside, against the two kernels in a row
      step gmm_push "${GMM_PUSH_LIMIT:-400}" python3 scripts/bench_gmm_push.py --out "$OUT/gmm_push.json" ${GMM_PUSH_ARGS:-} ;;
    arrive)  # the exchange before the GEMM inside it (push_gmm), against the push kernel and then the GEMM
      step arrive "${ARRIVE_LIMIT:-240}" python3 scripts/bench_gmm_push.py --passes up,ddown --out "$OUT/arrive.json" \
        ${GMM_PUSH_ARGS:-} ;;
    overlap)
      step overlap_default 150 python3 scripts/bench_push_overlap.py --rows "$ROWS" --gemm-rows $((4 * ROWS)) \
        --out "$OUT/overlap_default.json"
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true" step overlap_lhs 150 \
        python3 scripts/bench_push_overlap.py --rows "$ROWS" --gemm-rows $((4 * ROWS)) --out "$OUT/overlap_lhs.json" ;;
    depth_mem)
      depth_sets="--set train.micro_batch_size=$((8 * N)) --set model.remat=save_exchange $(ep_sets "$N")"
      for transport in push bucketed; do
        # shellcheck disable=SC2086  # depth_sets and SHAPES are lists of --set overrides
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/dump_$transport --xla_dump_hlo_module_re=.*step.*" \
          step "plan_$transport" 240 python3 -c "import sys; from xmoe_jax.cli import plan_main; sys.exit(plan_main())" --config configs/small.yaml --devices "$N" \
          --real-devices --out "$OUT/plan_$transport.json" $depth_sets --set parallel.transport=$transport ${SHAPES:-}
        find "$OUT/dump_$transport" -type f ! -name '*memory-usage-report*' -delete 2>/dev/null
      done
      TF_CPP_MIN_LOG_LEVEL=0 ep_step mem_push_bfc 200 "$N" 3 configs/small.yaml \
        --set train.micro_batch_size=$((8 * N)) --set model.remat=save_exchange --set train.tensorboard=false \
        --set parallel.transport=push
      grep -E "Sum Total|InUse at .* of size [0-9]{9,}|Chunk at .* of size [0-9]{9,}|Stats|Limit|InUse:|Largest" \
        "$OUT/mem_push_bfc.log" > "$OUT/mem_push_bfc.chunks.txt" 2>/dev/null
      gzip -f "$OUT/mem_push_bfc.log"
      TF_GPU_ALLOCATOR=cuda_malloc_async ep_step mem_push_async 200 "$N" 4 configs/small.yaml \
        --set train.micro_batch_size=$((8 * N)) --set model.remat=save_exchange --set train.tensorboard=false \
        --set parallel.transport=push ;;
    depth_*)  # depth_<transport>, or push with one lever (depth_shrink ... depth_stacks: the header)
      name=$part transport=${part#depth_} lever=""
      case $part in
        depth_shrink) name=push_$part transport=push lever="--set parallel.buffer_shrink_after=20" ;;
        depth_tgmm) name=push_$part transport=push && export XMOE_TGMM_GATHER=kernel ;;
        depth_stacks) name=push_$part transport=push && export XMOE_SCAN_STACKS=empty ;;
        depth_source) name=push_$part transport=push && export XMOE_ARRIVAL=source ;;
        depth_unfused) name=push_$part transport=push && export XMOE_FUSED_RETURN=off ;;
        depth_arrive) name=push_$part transport=push && export XMOE_FUSED_ARRIVE=on ;;
        depth_sized) name=push_$part transport=push lever="--set parallel.recv_buffer_factor=${SIZED_FACTOR:-2.5}" ;;
      esac
      # shellcheck disable=SC2086  # lever is a list of --set overrides
      ep_step "$name" "${DEPTH_LIMIT:-560}" "$N" "${DEPTH_STEPS:-60}" configs/small.yaml --log-every 10 \
        --set train.micro_batch_size=$((8 * N)) --set model.remat=save_exchange --set train.tensorboard=false \
        ${DEPTH_LAYERS:+--set model.num_layers=$DEPTH_LAYERS} --set parallel.transport="$transport" $lever
      unset XMOE_TGMM_GATHER XMOE_SCAN_STACKS XMOE_ARRIVAL XMOE_FUSED_RETURN XMOE_FUSED_ARRIVE ;;
  esac
done
summary
[ -f "$OUT/table.md" ] && cat "$OUT/table.md"
