"""XLA grouped GEMMs: the oracle every other backend is tested against, and the fallback.

Legend: R rows grouped by expert, K contraction, N output columns, E experts (groups).

`gmm` is `jax.lax.ragged_dot`; `tgmm` is `jax.lax.ragged_dot_general` with the ragged
dimension contracted (what JAX itself uses for ragged_dot's weight gradient). Both accumulate
in float32. On CUDA, XLA computes these densely (docs/design.md#ragged-dot: 6-24 TFLOP/s, and the
gradient can run out of memory at full size), so they are correct but not fast there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_TGMM_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def gmm_xla(lhs_RK, rhs_EKN, group_sizes_E, *, out_dtype, transpose_rhs: bool = False) -> jax.Array:
    """out[r] = lhs[r] @ rhs[group(r)] (rhs[group(r)].T with transpose_rhs); rows past the groups are 0."""
    if transpose_rhs:
        rhs_EKN = jnp.swapaxes(rhs_EKN, 1, 2)
    out = lax.ragged_dot(lhs_RK, rhs_EKN, group_sizes_E, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def tgmm_xla(lhs_RK, grad_RN, group_sizes_E, *, out_dtype) -> jax.Array:
    """out[e] = lhs[rows of e].T @ grad[rows of e]; [E, K, N], zero for empty groups."""
    out = lax.ragged_dot_general(
        lhs_RK, grad_RN, group_sizes_E, _TGMM_DIMS, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)
