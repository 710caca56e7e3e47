"""FP8 grouped GEMM on one GPU: a correctness check, then TFLOP/s beside same-run baselines.

    python scripts/bench_fp8.py --check --out check.json          # pallas FP8 kernel vs the oracle
    python scripts/bench_fp8.py --out fp8.json                     # Small and Large, uniform and Zipf
    python scripts/bench_fp8.py --torch --out torch.json           # torch._scaled_grouped_mm (own process:
                                                                   #   JAX preallocates the GPU's memory)
    python scripts/bench_fp8.py --sweep --out s.json               # the FP8 kernel's variants: float32
                                                                   #   promotion, weight layout, tiles
    python scripts/bench_fp8.py --dense --out d.json               # a dense projection: bf16 vs dot_fp8

Per config and group-size distribution: our bf16 gmm (forward; forward+backward), the FP8 kernel
alone on pre-quantized operands per recipe, gmm_fp8 with its just-in-time quantization (forward;
forward+backward), and baselines of the same FLOPs: a dense bf16 matmul and XLA's FP8 dense dot
(cuBLASLt). Up projection ([R, D] x [E, D, F]) only. Logic lives in xmoe_jax/perf/fp8_bench.py.
"""

from __future__ import annotations

import argparse
import sys

from xmoe_jax.perf import fp8_bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--check", action="store_true", help="only the on-device correctness check")
    p.add_argument("--torch", action="store_true", help="only the torch baselines")
    p.add_argument(
        "--sweep", action="store_true", help="only the FP8 kernel's variants (accumulation, layout, tiles)"
    )
    p.add_argument("--dense", action="store_true", help="only the dense projection (bf16 vs dot_fp8)")
    p.add_argument("--configs", default="small,large")
    p.add_argument("--dists", default="uniform,zipf")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    configs, dists = args.configs.split(","), args.dists.split(",")
    meta = {"command": " ".join(sys.argv)}
    if args.torch:
        rec = fp8_bench.Recorder(args.out, meta)
        fp8_bench.bench_torch(rec, configs, dists, args.iters)
        return
    from xmoe_jax.perf.timing import environment

    rec = fp8_bench.Recorder(args.out, {**meta, **environment()})
    if args.check:
        sys.exit(0 if fp8_bench.check(rec) else 1)
    if args.dense:
        fp8_bench.bench_dense(rec, args.iters)
        return
    if args.sweep:
        fp8_bench.bench_variants(rec, configs, dists, args.iters)
        return
    fp8_bench.bench(rec, configs, dists, args.iters)


if __name__ == "__main__":
    main()
