"""Measurement, apart from the training path: timing, benchmarks, models of cost and memory.

Nothing in the trainer imports this package. Modules:
  timing.py        wall-clock medians and the same-run dense-matmul ceiling;
  hlo.py           collective ops and bytes read from compiled HLO;
  moe_bench.py     one MoE layer and the bare exchange, timed (scripts/bench_moe_layer.py);
  stages.py        per-stage times of the shard_map dispatches, node-axis rows;
  compare.py       manual (shard_map) vs automatic (partitioner) sharding of the MoE layer;
  memory_model.py  analytic activation memory of the MoE block;
  rbd_cost.py      RBD's expected saving of cross-node rows.
  lowering.py      the train step exported for ROCm / CUDA from any host, and its kernel calls.
  step_breakdown.py where a traced step's time goes per GPU (trace_kernels.py reads the trace,
                   step_report.py draws the table and the picture).
"""
