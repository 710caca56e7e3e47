"""Uninitialised buffers for the stacks a scan builds: opt-in (XMOE_SCAN_STACKS=empty); measured mixed.

jax lowers every stacked output of a scan (`ys`: the layer scan's saved residuals, one [L, ...] stack per
saved tensor, built again for each micro-batch) from a buffer that starts as a broadcast of zeros:
`jax._src.lax.control_flow.loops._empty_array` uses `lax.empty2`, and jax's own TODO there says it
would use `lax.empty` (XLA's `AllocateBuffer` on GPU: no fill) "once AllocateBuffer issues are fixed".
The loop overwrites every slot, so the zero fill is memory traffic only. In the 28-layer push trace at
buffer factor 4 it is `loop_broadcast_fusion_27`, 106 ms of a 3,252 ms step (benchmarks/exchange.md).

`XMOE_SCAN_STACKS=empty` swaps that function for one that starts the stacks from `lax.empty`
(zeros on CPU, where `lax.empty` lowers to a broadcast; `AllocateBuffer` on CUDA and ROCm). It is
process-wide and must be on before the train step is first compiled: `apply_from_env()` runs at
start-up (train/loop.py). Where this jax has no such function, or an aval it does not expect
(another memory space), the original runs. Measured (benchmarks/exchange.md, 2026-11-28): the same
losses; +1.7% on one H200 at 8 layers with the same peak, but -0.9% and 8.6 GiB more at the peak
under EP 2 with push (XLA reused less memory around the stacks). Hence off by default.
"""

from __future__ import annotations

import logging
import os

from jax import lax
from jax._src import core
from jax._src.lax.control_flow import loops

log = logging.getLogger("xmoe_jax")
MODES = ("zeros", "empty")
_ORIGINAL = getattr(loops, "_empty_array", None)


def _uninitialised(prefix, length_spec, aval):
    """The stack [*prefix, *aval.shape] as `lax.empty`, sharded and varying as jax's own zeros."""
    device_space = getattr(getattr(core, "MemorySpace", None), "Device", None)
    if getattr(aval, "memory_space", device_space) != device_space:
        return _ORIGINAL(prefix, length_spec, aval)
    sharding = aval.sharding
    get_mesh = getattr(loops, "get_abstract_mesh", None)
    if sharding.mesh.empty and get_mesh is not None:
        sharding = sharding.update(mesh=get_mesh())
    sharding = sharding.update(
        spec=sharding.spec.update(partitions=(*length_spec, *sharding.spec.partitions))
    )
    with loops.use_abstract_mesh(sharding.mesh):
        out = lax.empty((*prefix, *aval.shape), aval.dtype, out_sharding=sharding)
    return core.pvary(out, tuple(aval.mat.varying))


def mode() -> str:
    """XMOE_SCAN_STACKS: `zeros` (jax's own, the default) or `empty`; anything else is refused."""
    value = os.environ.get("XMOE_SCAN_STACKS") or "zeros"
    if value not in MODES:
        raise ValueError(f"XMOE_SCAN_STACKS={value!r}: use one of {MODES} (or unset it for jax's zeros)")
    return value


def apply(value: str) -> bool:
    """Start scan stacks from `lax.empty` (value `empty`) or jax's zeros (`zeros`); True when the
    uninitialised stacks are on after the call."""
    if _ORIGINAL is None:
        if value == "empty":
            log.warning(
                "XMOE_SCAN_STACKS=empty: this jax has no loops._empty_array; scan stacks start as zeros"
            )
        return False
    loops._empty_array = _uninitialised if value == "empty" else _ORIGINAL
    return value == "empty"


def apply_from_env() -> bool:
    """`apply(mode())`, logged when on: call before the first compile of a step."""
    on = apply(mode())
    if on:
        log.info("XMOE_SCAN_STACKS=empty: scan stacks start uninitialised (lax.empty; launch/scan_stacks.py)")
    return on
