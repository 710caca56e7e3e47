"""GEMM operands in FP8 with their scales laid out the way the FP8 kernels read them.

Legend: M rows, K contraction, N output columns, E experts, B K-blocks (cdiv(K, block_k) for
the blockwise recipe, 1 otherwise).

    q_MK, s_MB   = quantize_lhs(x_MK, recipe, dtype)     # x[m, k] ~ q[m, k] * s[m, k // block_k]
    q_EKN, s_EBN = quantize_rhs(w_EKN, recipe, dtype)    # w[e, k, n] ~ q[e, k, n] * s[e, k // block_k, n]

Every recipe's scales are broadcast to these two layouts (a tensorwise scale to [M, 1] and
[E, 1, N], a 128x128 block scale repeated over its block's 128 columns), so one kernel and one
oracle serve all three recipes: with B = 1 the scales factor out of the K loop and are applied in
the epilogue; with B > 1 each K-block's partial product is scaled before it is accumulated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.fp8.quantize import quantize
from xmoe_jax.fp8.recipe import Recipe


def quantize_lhs(x_MK: jax.Array, recipe: Recipe, dtype) -> tuple[jax.Array, jax.Array]:
    """(fp8 [M, K], float32 scales [M, B])."""
    q_MK, s = quantize(x_MK, recipe.lhs_block(), dtype)
    return q_MK, jnp.broadcast_to(s, (x_MK.shape[0], s.shape[1]))


def quantize_rhs(w_EKN: jax.Array, recipe: Recipe, dtype) -> tuple[jax.Array, jax.Array]:
    """(fp8 [E, K, N], float32 scales [E, B, N])."""
    e_dim, _, n_dim = w_EKN.shape
    q_EKN, s = quantize(w_EKN, recipe.rhs_block(), dtype)
    if s.shape[2] > 1:  # 128x128 blocks: each block's scale repeated over its columns
        block_n = recipe.rhs_block()[2]
        s = jnp.repeat(s, block_n, axis=2, total_repeat_length=s.shape[2] * block_n)[:, :, :n_dim]
    return q_EKN, jnp.broadcast_to(s, (e_dim, s.shape[1], n_dim))
