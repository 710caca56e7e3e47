"""Headroom under a step's temporaries: slack so that XLA's GPU allocator can place the next step.

XLA:GPU (jax 0.11.2) takes a step's temporaries as one block from the lower end of its BFC pool;
some of the step's outputs land above that block and stay while the loop still holds them. Between
two steps, small allocations (the next batch, the next step's first outputs) then fall into the
hole the block left, and a block of the same size no longer fits there, although the pool has room.
Measured: the 28-layer push step on 4x H200 asked 51.96 GiB with 94.9 GiB free, its hole 512 KiB
short (the next batch), and failed in its second step (benchmarks/exchange.md).

`reserve` allocates a small cushion on every device of the mesh before an executable's first run,
so its temporaries are placed above the cushion; `release` waits for that run and frees the cushion.
The hole under the block is then the block plus the cushion, and what lands there between steps
takes the slack instead of the block's room. A first run also keeps small buffers for as long as
its executable lives (six of 256 B at the top of the 28-layer push step's block in the allocator's
dump, most likely the Mosaic kernels' tables of peer addresses), carved above the block when no
small hole is free; so `reserve` first leaves such a hole (LANDING_BYTES, allocated under the
cushion and freed). Otherwise those six would part the block's hole from the free space above it,
and a rung change's larger step would not fit. One cushion per compiled step, never during steady
state; on CPU (no such allocator) and where the pool has no room left it does nothing.

The other half is in train/buffers.py: where the buffer ladder waits for every step, the step's
metrics move to the host at once, so when a rung change compiles a larger step, the hole the last
one left and the free space above it are one block again. Measured: with the cushion alone the
28-layer push run trained at rung 1.2 and then failed its rung 1.5 step (55.23 GiB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

CUSHION_BYTES = 256 << 20  # far above what lands between steps (a batch, a step's metrics)
LANDING_BYTES = 1 << 20  # a hole for what a first run keeps (its kernels' peer tables: 256 B each)
PLATFORMS = ("gpu",)  # jax.default_backend() values whose allocator needs it


def reserve(mesh, nbytes: int | None = None, platforms: tuple[str, ...] | None = None) -> jax.Array | None:
    """`nbytes` (default CUSHION_BYTES) on every device of `mesh` (uint8, one shard each), or None
    off `platforms` (default PLATFORMS) or where no device has the room (the step runs as it would
    without)."""
    nbytes = CUSHION_BYTES if nbytes is None else nbytes
    if jax.default_backend() not in (platforms or PLATFORMS) or nbytes <= 0:
        return None
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))

    def per_device(size: int) -> jax.Array:
        out = jax.jit(lambda: jnp.zeros((mesh.size * size,), jnp.uint8), out_shardings=sharding)()
        return out.block_until_ready()  # placed before the next allocation

    try:
        landing = per_device(LANDING_BYTES)
        cushion = per_device(nbytes)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None
    landing.delete()  # a small free hole for the run's own small, long-lived buffers
    return cushion


def release(cushion: jax.Array | None, outputs) -> None:
    """Frees `cushion` once the run that produced `outputs` is done (its temporaries placed)."""
    if cushion is None:
        return
    jax.block_until_ready(outputs)
    cushion.delete()
