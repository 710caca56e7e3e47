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


def expand_k(s_xB, k_dim: int, block_k: int, axis: int) -> jax.Array:
    """Scales along K repeated to one per K index (B = 1: left to broadcast)."""
    if s_xB.shape[axis] == 1:
        return s_xB
    return jnp.take(s_xB, jnp.arange(k_dim) // block_k, axis=axis)


def gmm_fp8_xla(lhs_q_RK, lhs_s_RB, rhs_q_EKN, rhs_s_EBN, group_sizes_E, *, out_dtype, block_k) -> jax.Array:
    """The FP8 oracle: dequantize both operands (q * scale) and run gmm in float32.

    Scales as xmoe_jax/fp8/operands.py lays them out: lhs [R, B], rhs [E, B, N], B K-blocks of
    `block_k` (B = 1: one scale along K). Runs anywhere, exact up to float32 rounding.
    """
    k_dim = lhs_q_RK.shape[1]
    # the barrier keeps XLA:GPU from folding the quantize's f32 -> fp8 -> f32 round trip away
    # (xla_allow_excess_precision); without it the on-GPU oracle multiplied unquantized values
    lhs_q_RK, rhs_q_EKN = lax.optimization_barrier((lhs_q_RK, rhs_q_EKN))
    lhs = lhs_q_RK.astype(jnp.float32) * expand_k(lhs_s_RB, k_dim, block_k, axis=1)
    rhs = rhs_q_EKN.astype(jnp.float32) * expand_k(rhs_s_EBN, k_dim, block_k, axis=1)
    out = lax.ragged_dot(lhs, rhs, group_sizes_E, precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype)
