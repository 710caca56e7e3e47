"""`padded` dispatch: the capacity baseline (Tutel-style index scatter/gather).

Shapes: T tokens, D model, E experts, K top-k, C capacity per expert.

Steps: each kept routed copy (t, k) gets slot e*C + position-in-expert; rows are
scattered into a zero-padded [E, C, D] buffer, the experts run as one batched
matmul, and the outputs are gathered back from the same slots and combined with the
routing weights. Copies past capacity land in no slot and contribute zero. Empty
slots are still computed: that padding is what PFT removes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.moe.experts import batched_experts


def padded_dispatch(
    x_TD: jax.Array,
    topk_idx_TK: jax.Array,
    gate_TK: jax.Array,
    keep_TK: jax.Array,
    pos_TK: jax.Array,
    capacity: int,
    experts: dict,
    activation: str,
    constrain,
) -> jax.Array:
    num_experts = experts["w_up"].shape[0]
    num_tokens, top_k = topk_idx_TK.shape
    dim = x_TD.shape[-1]
    num_slots = num_experts * capacity
    slot_TK = jnp.where(keep_TK, topk_idx_TK * capacity + pos_TK, num_slots)  # dropped -> out of range
    x_AD = jnp.repeat(x_TD, top_k, axis=0)
    buf_SD = jnp.zeros((num_slots, dim), x_TD.dtype).at[slot_TK.reshape(-1)].set(x_AD, mode="drop")
    buf_ECD = constrain(buf_SD.reshape(num_experts, capacity, dim), ("experts", "capacity", "embed"))
    out_ECD = constrain(batched_experts(buf_ECD, experts, activation), ("experts", "capacity", "embed"))
    out_SD = out_ECD.reshape(num_slots, dim)
    y_TKD = out_SD.at[slot_TK].get(mode="fill", fill_value=0)
    y_TD = jnp.einsum("tk,tkd->td", gate_TK, y_TKD.astype(jnp.float32))
    return y_TD.astype(x_TD.dtype)
