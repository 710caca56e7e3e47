"""The activation's backward with the routing weight (kernels/act_grad) on the one-GPU step's rows.

    python scripts/bench_act_grad.py --out act_grad.json        # one GPU, about a minute
    python scripts/bench_act_grad.py --tiny --out /tmp/a.json    # CPU dry run (interpret mode)

Rows of the X-MoE Small experts on one device (393,216 = 65,536 tokens x top-6, F 1408, bf16), GELU
and SwiGLU: each backend's act_grad is checked against the float32 XLA reference (relative error),
then timed beside the same-run baseline, a device copy of the same bytes (what the pass must move:
the hidden matrices and u read, d hidden and act * g written); the table gives each one's GB/s and
its time over the copy's. The `xla` row is the reference itself: what XLA makes of the expressions.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.kernels.act_grad import act_grad
from xmoe_jax.perf.recorder import Recorder
from xmoe_jax.perf.timing import environment, time_fn


def main(args) -> None:
    rows, f_dim = (64, 40) if args.tiny else (393_216, 1408)
    rec = Recorder(args.out, {**environment(), "rows": rows, "f": f_dim, "dtype": "bfloat16"})
    table = []
    for activation in ("gelu", "swiglu"):
        keys = jax.random.split(jax.random.key(0), 4)
        up = jax.random.normal(keys[0], (rows, f_dim), jnp.bfloat16)
        gate = jax.random.normal(keys[1], (rows, f_dim), jnp.bfloat16) if activation == "swiglu" else None
        u = jax.random.normal(keys[2], (rows, f_dim), jnp.bfloat16)
        g = jax.random.uniform(keys[3], (rows,))
        n = 2 if gate is not None else 1
        moved = (2 * n + 2) * rows * f_dim * 2 + rows * 8  # read hidden and u, write d hidden and act*g
        copy_src = jnp.zeros((moved // 4,), jnp.bfloat16) + 1  # a copy reads and writes: moved / 2 each
        t_copy = time_fn(jax.jit(lambda x: x * 1), copy_src, iters=args.iters)
        rec.add(activation=activation, variant="copy_same_bytes", ms=t_copy * 1e3, gbps=moved / t_copy / 1e9)
        ref = None
        for impl in ("xla", "pallas"):
            fn = jax.jit(
                lambda gt, up, u, g, impl=impl, a=activation: act_grad((gt, up), u, g, a, implementation=impl)
            )
            out = jax.tree.leaves(fn(gate, up, u, g))
            if ref is None:
                ref = out
            err = max(
                float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
                / max(float(np.abs(np.asarray(b, np.float32)).max()), 1e-30)
                for a, b in zip(out, ref, strict=True)
            )
            t = time_fn(fn, gate, up, u, g, iters=args.iters)
            rec.add(activation=activation, variant=impl, ms=t * 1e3, gbps=moved / t / 1e9, rel_err=err)
            table.append((activation, impl, t * 1e3, moved / t / 1e9, t / t_copy, err))
    print("| activation | backend | ms | GB/s | x copy of the same bytes | rel. err vs xla |")
    print("|---|---|---:|---:|---:|---:|")
    for a, impl, ms, gbps, ratio, err in table:
        print(f"| {a} | {impl} | {ms:.3f} | {gbps:.0f} | {ratio:.2f} | {err:.1e} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes that run on a CPU in seconds")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    main(p.parse_args())
