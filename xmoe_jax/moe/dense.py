"""`dense` dispatch: every expert sees every token; the numerical oracle.

Shapes: T tokens, D model, E experts, K top-k. Memory is O(E*T*(D+F)): tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.moe.experts import batched_experts


def combine_weights_TE(topk_idx_TK: jax.Array, gate_TK: jax.Array, num_experts: int) -> jax.Array:
    """Dense [T, E] matrix of combine weights (zero for experts not chosen or dropped)."""
    num_tokens = topk_idx_TK.shape[0]
    rows_TK = jnp.broadcast_to(jnp.arange(num_tokens)[:, None], topk_idx_TK.shape)
    return jnp.zeros((num_tokens, num_experts), jnp.float32).at[rows_TK, topk_idx_TK].add(gate_TK)


def dense_dispatch(
    x_TD: jax.Array, topk_idx_TK: jax.Array, gate_TK: jax.Array, experts: dict, activation: str, constrain
) -> jax.Array:
    """y_TD = sum_e gates_TE[t, e] * expert_e(x_TD[t]) with all experts run on all tokens."""
    num_experts = experts["w_up"].shape[0]
    gates_TE = combine_weights_TE(topk_idx_TK, gate_TK, num_experts)
    x_ETD = constrain(jnp.broadcast_to(x_TD, (num_experts, *x_TD.shape)), ("experts", "capacity", "embed"))
    out_ETD = constrain(batched_experts(x_ETD, experts, activation), ("experts", "capacity", "embed"))
    y_TD = jnp.einsum("te,etd->td", gates_TE, out_ETD.astype(jnp.float32))
    return y_TD.astype(x_TD.dtype)
