"""Minimal reproduction: `jax.lax.ragged_all_to_all` on 2+ GPUs under each XLA preset.

    XMOE_RAGGED_A2A=sendrecv timeout 60 python scripts/repro_ragged_sendrecv.py

Every device sends `rows` rows to every other device (and to itself) through one
ragged_all_to_all inside shard_map, then checks the received rows against what must
arrive. Prints the preset, the XLA flags, jax/jaxlib versions, and OK with the time of
a call, or the error; a hang shows as the caller's timeout. The result for the GPU
machines is recorded in benchmarks/exchange.md.
"""

from __future__ import annotations

import argparse
import os
import time

from xmoe_jax.launch.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--dim", type=int, default=2048)
    args = p.parse_args()
    n, rows, dim = jax.device_count(), args.rows, args.dim
    print(
        f"preset={os.environ.get('XMOE_RAGGED_A2A', 'decomposer (default)')} XLA_FLAGS={os.environ.get('XLA_FLAGS')}"
    )
    print(
        f"jax {jax.__version__} jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}, {n} x {jax.devices()[0].device_kind}"
    )
    mesh = Mesh(np.asarray(jax.devices()), ("x",))

    def body(x_ND):
        me = jax.lax.axis_index("x")
        sizes = jnp.full((n,), rows, jnp.int32)
        offsets = jnp.arange(n, dtype=jnp.int32) * rows
        out = jnp.zeros((n * rows, dim), x_ND.dtype)
        return jax.lax.ragged_all_to_all(
            x_ND, out, offsets, sizes, jnp.full((n,), me * rows, jnp.int32), sizes, axis_name="x"
        )

    spec = PartitionSpec("x")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jnp.arange(n * n * rows, dtype=jnp.float32)[:, None] * jnp.ones((1, dim), jnp.float32)
    x = jax.device_put(x.astype(jnp.bfloat16), NamedSharding(mesh, spec))
    try:
        t0 = time.perf_counter()
        y = jax.block_until_ready(fn(x))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        got = np.asarray(y[:, 0], np.float32).reshape(n, n, rows)  # [dest, source, row]
        want = np.asarray(x[:, 0], np.float32).reshape(n, n, rows).transpose(1, 0, 2)
        print(
            f"OK={bool(np.array_equal(got, want))} first call {first:.2f} s, second {1e3 * (time.perf_counter() - t0):.2f} ms"
        )
    except Exception as err:  # report, do not hide
        print(f"ERROR {type(err).__name__}: {str(err)[:500]}")


if __name__ == "__main__":
    main()
