"""Capacity: which routed copies an expert keeps when its buffer is bounded.

Shapes: T tokens, K top-k, A = T*K routed copies (assignment a = t*K + k), E experts.

Every dispatch mode that drops uses `expert_positions` on the tokens it sees: dense and
padded see the whole batch, pft and rbd one source shard each (placement.py). So dense and
padded drop the same copies, pft and rbd drop the same copies as each other, and all four agree
when the tokens are on one shard (examples/moe_layer.py shows both cases).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_positions(
    topk_idx_TK: jax.Array, topk_weight_TK: jax.Array, num_experts: int, policy: str
) -> jax.Array:
    """Rank of each routed copy inside its expert's queue, int32 [T, K].

    policy `probs`: highest routing weight first (ties: earlier token, lower slot);
    policy `position`: all first choices in token order, then all second choices, ...
    (GShard/Tutel priority).
    """
    num_tokens, top_k = topk_idx_TK.shape
    num_copies = num_tokens * top_k
    expert_A = topk_idx_TK.reshape(-1)
    if policy == "probs":
        priority_A = jnp.argsort(-topk_weight_TK.reshape(-1), stable=True)
    elif policy == "position":
        # a = t*K + k -> order by (k, t)
        priority_A = jnp.arange(num_copies).reshape(num_tokens, top_k).T.reshape(-1)
    else:
        raise ValueError(f"drop_policy={policy!r} is not 'probs' or 'position'")
    by_expert = jnp.argsort(expert_A[priority_A], stable=True)
    order_A = priority_A[by_expert]  # copies sorted by (expert, priority)
    counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_A].add(1)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_A = jnp.arange(num_copies, dtype=jnp.int32) - starts_E[expert_A[order_A]]
    pos_A = jnp.zeros((num_copies,), jnp.int32).at[order_A].set(rank_A)
    return pos_A.reshape(num_tokens, top_k)


def keep_mask(
    topk_idx_TK: jax.Array, topk_weight_TK: jax.Array, num_experts: int, capacity: int | None, policy: str
) -> tuple[jax.Array, jax.Array]:
    """(keep_TK bool, position_TK int32); everything is kept when capacity is None."""
    pos_TK = expert_positions(topk_idx_TK, jax.lax.stop_gradient(topk_weight_TK), num_experts, policy)
    if capacity is None:
        return jnp.ones(topk_idx_TK.shape, bool), pos_TK
    return pos_TK < capacity, pos_TK
