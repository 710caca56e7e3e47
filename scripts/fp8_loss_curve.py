"""Training loss with FP8 off and on (one run per recipe), same seed and data, plus a plot.

    python scripts/fp8_loss_curve.py --config configs/tiny_text.yaml --steps 300 \
        --set parallel.dispatch=pft --out benchmarks/results/fp8_loss_tiny_text_cpu.json

Writes the curves and the relative gap of the final losses (mean of the last 5 logged) to --out
and a PNG beside it. On a GPU use --config configs/tiny_small_shape.yaml with real text.
"""

from __future__ import annotations

import argparse
import pathlib

from xmoe_jax.perf import fp8_curve
from xmoe_jax.perf.timing import environment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--recipes", default="blockwise,rowwise", help="FP8 runs: recipe names, each optionally "
                   "with +fast_accum (e.g. rowwise+fast_accum)")  # fmt: skip
    p.add_argument("--no-off", action="store_true", help="skip the run without FP8 (to add FP8 runs to an earlier "
                   "curve of the same config, seed and data)")  # fmt: skip
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = pathlib.Path(args.out)
    meta = {**environment(), "config": args.config, "overrides": args.overrides, "steps": args.steps}
    curves = fp8_curve.loss_curves(
        args.config, args.overrides, args.steps, args.recipes.split(","), args.log_every,
        on_run=lambda done: fp8_curve.write(done, meta, out), off=not args.no_off,
    )  # fmt: skip
    fp8_curve.plot(curves, out.with_suffix(".png"), f"{pathlib.Path(args.config).stem}: FP8 vs no FP8")
    print(fp8_curve.summary(curves))


if __name__ == "__main__":
    main()
