"""What FP8 adds to the train step XLA must compile, counted on a CPU host (no GPU needed).

    PYTHONPATH=. python scripts/fp8_compile_census.py --config configs/tiny_small_shape.yaml \
        --set model.attention=xla [--set 'model.fp8={recipe: rowwise}'] [--platform cuda] [--hopper]

Exports the step for `--platform` as `tests/test_lowering.py` does (xmoe_jax/perf/lowering.py: the
kernels chosen for that GPU, nothing compiled) and counts, in its StableHLO:
  - dot_general ops by operand types, and the distinct (shape, types) among them: XLA:GPU autotunes
    each distinct GEMM fusion (cuBLASLt algorithms, Triton GEMM tile configs), so that number, not
    the count, drives compile time;
  - converts into a float8 type (the quantize fusions' outputs) and reductions (their amax);
  - Pallas/Triton kernel calls by name, and distinct kernels (a Triton compile each).
Prints one JSON line per run; README "FP8" reads them (bf16 vs FP8) to explain FP8's compile.
`model.attention=xla`: cuDNN attention asks the installed cuDNN while tracing (a CPU host has none);
the attention core is bf16 with or without FP8.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_DOT = re.compile(
    r"stablehlo\.dot_general %\S+, %\S+,.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
)
_F8_CONVERT = re.compile(r"stablehlo\.convert %\S+ : \(tensor<[^>]*>\) -> tensor<[^>]*f8E\w+>")
_REDUCE = re.compile(r"stablehlo\.reduce\(")
_TRITON = re.compile(r'stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)".*?: \(([^)]*)\)')


def census(text: str) -> dict:
    dots, shapes = Counter(), set()
    for lhs, rhs, out in _DOT.findall(text):
        kind = "fp8" if "f8E" in lhs or "f8E" in rhs else lhs.rsplit("x", 1)[-1].rstrip(">")
        dots[kind] += 1
        shapes.add((lhs, rhs, out))
    fp8_shapes = {s for s in shapes if "f8E" in s[0] or "f8E" in s[1]}
    kernels = _TRITON.findall(text)
    return {
        "dot_general": dict(dots),
        "distinct_dots": len(shapes),
        "distinct_fp8_dots": len(fp8_shapes),
        "converts_to_fp8": len(_F8_CONVERT.findall(text)),
        "reduces": len(_REDUCE.findall(text)),
        "triton_calls": dict(Counter(name for name, _ in kernels)),
        "distinct_triton_kernels": len(set(kernels)),
        "module_chars": len(text),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--platform", default="cuda")
    p.add_argument(
        "--hopper",
        action="store_true",
        help="trace for an H100 (sm_90): the kernels an H100 picks, FP8 ones included",
    )
    args = p.parse_args()
    from xmoe_jax.config import load_config
    from xmoe_jax.kernels import platform
    from xmoe_jax.perf.lowering import export_train_step, kernel_calls

    if args.hopper:  # no device to ask on a CPU host; the H100's answer
        platform._first_device_is_hopper = lambda: True

    cfg = load_config(args.config, args.overrides)
    text = export_train_step(cfg, args.platform, num_devices=1).mlir_module()
    out = {"config": args.config, "overrides": args.overrides, "hopper": args.hopper, **census(text)}
    print(json.dumps({**out, "custom_calls": dict(kernel_calls(text))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
