"""Shape-only stand-ins for kernels, for compile-time memory planning (xmoe-plan on CPU).

A GPU kernel (a grouped GEMM, a permute, flash attention) holds its inputs and writes its
outputs and nothing else. XLA:CPU has no such kernels: its dense ragged_dot lowering and an
interpreted Pallas kernel allocate workspaces a GPU never sees, and XLA attention keeps the
[B,H,S,S] scores that flash attention never materialises. `opaque(shape, *operands)` is a host
callback that returns an array of `shape` and depends on `operands`: compiled, it costs exactly
its output. It is never meant to run (it returns zeros); `XMOE_KERNELS=shapes` selects it for
every kernel and for attention, which is what `xmoe-plan` does on CPU.
"""

from __future__ import annotations

import os

import jax
import numpy as np


def enabled() -> bool:
    return os.environ.get("XMOE_KERNELS") == "shapes"


def opaque(out: jax.ShapeDtypeStruct, *operands) -> jax.Array:
    """An array of `out`'s shape and dtype that depends on `operands` (zeros if ever run)."""
    return jax.pure_callback(
        lambda *_: np.zeros(out.shape, out.dtype), out, *operands, vmap_method="broadcast_all"
    )
