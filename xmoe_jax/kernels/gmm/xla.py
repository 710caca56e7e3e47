"""XLA grouped GEMMs: the oracle every other backend is tested against, and the fallback.

Legend: R rows grouped by expert, L lhs rows, O output rows, K contraction, N output columns,
E experts (groups).

`gmm` is `jax.lax.ragged_dot`; `tgmm` is `jax.lax.ragged_dot_general` with the ragged
dimension contracted (what JAX itself uses for ragged_dot's weight gradient). Row indices
(api.py) are a gather before them and a scatter after: the materialised copies the kernels
avoid, but the plainest statement of what they compute. Both accumulate
in float32. On CUDA, XLA computes these densely (docs/design.md#ragged-dot: 6-24 TFLOP/s, and the
gradient can run out of memory at full size), so they are correct but not fast there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from xmoe_jax.kernels.gmm.fp8_call import Fp8Gmm

_TGMM_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def live_rows(group_sizes_E, num_rows: int) -> jax.Array:
    """bool [R]: the grouped rows that exist, r < sum(group_sizes) (clipped to R)."""
    return jnp.arange(num_rows, dtype=jnp.int32) < jnp.sum(group_sizes_E.astype(jnp.int32))


def gather_rows(x_LK, rows_R) -> jax.Array:
    """x[rows[r]] per grouped row; an index outside [0, L) reads zeros."""
    return jnp.take(x_LK, rows_R, axis=0, mode="fill", fill_value=0)


def scatter_rows(out_RN, rows_R, group_sizes_E, num_out_rows: int) -> jax.Array:
    """[O, N] with row rows[r] = out[r] for r < sum(group_sizes); the other rows are zeros (one
    instance of the unspecified rows that api.py documents)."""
    dest_R = jnp.where(live_rows(group_sizes_E, out_RN.shape[0]), rows_R, num_out_rows)
    out_ON = jnp.zeros((num_out_rows, out_RN.shape[1]), out_RN.dtype)
    return out_ON.at[dest_R].set(out_RN, mode="drop")


def gmm_xla(
    lhs_LK, rhs_EKN, group_sizes_E, *, out_dtype, transpose_rhs: bool = False, lhs_rows_R=None, out_rows_R=None,
    num_out_rows=None,
) -> jax.Array:  # fmt: skip
    """out[out_rows[r]] = lhs[lhs_rows[r]] @ rhs[group(r)] (rhs[group(r)].T with transpose_rhs) for
    r < sum(group_sizes): gather, ragged_dot, scatter. Every other output row is 0."""
    if lhs_rows_R is not None:
        lhs_LK = gather_rows(lhs_LK, lhs_rows_R)
    if transpose_rhs:
        rhs_EKN = jnp.swapaxes(rhs_EKN, 1, 2)
    out = lax.ragged_dot(lhs_LK, rhs_EKN, group_sizes_E, preferred_element_type=jnp.float32)
    if out_rows_R is not None:
        out = scatter_rows(out, out_rows_R, group_sizes_E, num_out_rows)
    return out.astype(out_dtype)


def tgmm_xla(lhs_LK, grad_GN, group_sizes_E, *, out_dtype, lhs_rows_R=None, grad_rows_R=None) -> jax.Array:
    """out[e] = lhs[lhs_rows[rows of e]].T @ grad[grad_rows[rows of e]]; [E, K, N], zero for empty groups."""
    if lhs_rows_R is not None:
        lhs_LK = gather_rows(lhs_LK, lhs_rows_R)
    if grad_rows_R is not None:
        grad_GN = gather_rows(grad_GN, grad_rows_R)
    out = lax.ragged_dot_general(
        lhs_LK, grad_GN, group_sizes_E, _TGMM_DIMS, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)


def expand_k(s_xB, k_dim: int, block_k: int, axis: int) -> jax.Array:
    """Scales along K repeated to one per K index (B = 1: left to broadcast)."""
    if s_xB.shape[axis] == 1:
        return s_xB
    return jnp.take(s_xB, jnp.arange(k_dim) // block_k, axis=axis)


def gmm_fp8_xla(call: Fp8Gmm) -> jax.Array:
    """The FP8 oracle: dequantize both operands (q * scale) and run gmm in float32, rows as gmm_xla.

    Scales as xmoe_jax/fp8/operands.py lays them out: lhs [L, B], rhs [E, B, N], B K-blocks of
    `block_k` (B = 1: one scale along K). Runs anywhere, exact up to float32 rounding.
    """
    k_dim = call.lhs_q_LK.shape[1]
    # the barrier keeps XLA:GPU from folding the quantize's f32 -> fp8 -> f32 round trip away
    # (xla_allow_excess_precision); without it the on-GPU oracle multiplied unquantized values
    lhs_q_LK, rhs_q_EKN = lax.optimization_barrier((call.lhs_q_LK, call.rhs_q_EKN))
    lhs = lhs_q_LK.astype(jnp.float32) * expand_k(call.lhs_s_LB, k_dim, call.block_k, axis=1)
    rhs = rhs_q_EKN.astype(jnp.float32) * expand_k(call.rhs_s_EBN, k_dim, call.block_k, axis=1)
    if call.lhs_rows_R is not None:
        lhs = gather_rows(lhs, call.lhs_rows_R)
    out = lax.ragged_dot(lhs, rhs, call.group_sizes_E, precision=lax.Precision.HIGHEST)
    if call.out_rows_R is not None:
        out = scatter_rows(out, call.out_rows_R, call.group_sizes_E, call.num_out_rows)
    return out.astype(call.out_dtype)
