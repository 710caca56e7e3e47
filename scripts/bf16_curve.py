"""Loss curves of configs/tiny.yaml with a float32 and a bfloat16 setting of one dtype field, on CPU
with 8 fake devices; prints 50-step window means and writes every step's loss as JSON.

    PYTHONPATH=$PWD python scripts/bf16_curve.py --steps 300 --out /tmp/bf16_curve    # AdamW moments
    PYTHONPATH=$PWD python scripts/bf16_curve.py --field train.grad_accum_dtype \
        --set train.batch_size=32 --set train.micro_batch_size=8 --steps 300 --out /tmp/accum_curve

Results: benchmarks/bf16_moments_cpu.md (moments; test: tests/test_optimizer.py, marked slow) and
benchmarks/grad_accum_cpu.md (the micro-batches' gradient sum).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from xmoe_jax.config import load_config  # noqa: E402
from xmoe_jax.train.loop import train  # noqa: E402

WINDOW = 50
FIELDS = ("optimizer.state_dtype", "train.grad_accum_dtype")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--field", choices=FIELDS, default=FIELDS[0], help="the dtype field the two runs differ in")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=pathlib.Path, required=True, help="run directories and losses.json")
    args = p.parse_args()
    losses = {}
    for dtype in ("float32", "bfloat16"):
        t0 = time.time()
        cfg = load_config(
            "configs/tiny.yaml",
            [
                f"train.run_dir={args.out / dtype}",
                f"train.steps={args.steps}",
                "train.log_every=50",
                "checkpoint.enabled=false",
                "train.tensorboard=false",
                *args.overrides,
                f"{args.field}={dtype}",
            ],
        )
        result = train(cfg)
        losses[dtype] = [result.losses[s] for s in sorted(result.losses)]
        print(f"{dtype}: {time.time() - t0:.0f} s", flush=True)
    f32, bf16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
    for lo in range(0, args.steps, WINDOW):
        a, b = f32[lo : lo + WINDOW].mean(), bf16[lo : lo + WINDOW].mean()
        print(f"steps {lo + 1}-{lo + WINDOW}: float32 {a:.4f} bfloat16 {b:.4f} ({(b - a) / a:+.2%})")
    print(f"largest per-step difference {np.abs(f32 - bf16).max():.4f}")
    (args.out / "losses.json").write_text(json.dumps({"field": args.field, "overrides": args.overrides, **losses}))


if __name__ == "__main__":
    main()
