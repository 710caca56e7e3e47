"""The MoE block's body: route, keep, run the dispatch's stages, statistics.

Shapes: T tokens (the shard's, or the whole batch), D model, E experts, K top-k.

The same body runs per device inside the block's shard_map (pft, rbd) and on the
whole batch under XLA's partitioner (dense, padded, pft with auto_shard); the
placement (placement.py) says which, and `token_axes` are then the mesh axes the
tokens are split over (empty outside shard_map), over which statistics are reduced
so they are those of the whole batch.

Steps:
  1. router logits in float32, top-k choice and combine weights (router.py);
  2. capacity: with `capacity_factor`, each expert keeps at most
     C = ceil(cf * T * k / E) copies, chosen by `drop_policy` (capacity.py);
  3. the dispatch's stages (dispatchers.py): send, exchange, experts, combine; with the
     shared experts inside the block (`place.shared_inside`, overlap.py) they are traced
     after the dispatch exchange and added to the routed output;
  4. expert-tensor parallelism: partial outputs summed over the tensor axis;
  5. statistics: routing (loads, drops, balance and z losses) and exchange.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig, ParallelConfig
from xmoe_jax.moe import overlap, router
from xmoe_jax.moe.capacity import keep_mask
from xmoe_jax.moe.dispatchers import DISPATCHERS
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.moe.stages import run
from xmoe_jax.moe.stats import PER_DEVICE, ExchangeStats, MoEStats
from xmoe_jax.remat import ROUTING, tag


class Kept(NamedTuple):
    """The routed copies after capacity."""

    topk_idx_TK: jax.Array  # int32 expert ids
    gate_TK: jax.Array  # float32 combine weights, zero where dropped
    keep_TK: jax.Array  # bool
    pos_TK: jax.Array  # int32 rank of each copy in its expert's queue
    capacity: int | None  # per-expert capacity C (None: dropless)


def route_and_keep(x_TD: jax.Array, router_params: dict, cfg: MoEConfig) -> tuple[router.Routing, Kept]:
    """Routing, then capacity (steps 1 and 2)."""
    bias_E = router_params.get("bias") if cfg.has_router_bias else None
    routing = router.route(x_TD, router_params["kernel"], bias_E, cfg)
    routing = routing._replace(topk_idx_TK=tag(routing.topk_idx_TK, ROUTING))  # remat keeps the choice
    capacity = cfg.capacity(x_TD.shape[0]) if cfg.capacity_factor is not None else None
    keep_TK, pos_TK = keep_mask(
        routing.topk_idx_TK, routing.topk_weight_TK, cfg.num_experts, capacity, cfg.drop_policy
    )
    gate_TK = jnp.where(keep_TK, routing.topk_weight_TK, 0.0)
    return routing, Kept(routing.topk_idx_TK, gate_TK, keep_TK, pos_TK, capacity)


def _balance_loss(routing: router.Routing, cfg: MoEConfig, seq_len, token_axes) -> jax.Array:
    scores_TE, idx_TK = routing.scores_TE, routing.topk_idx_TK
    if cfg.aux_loss_type == "sequence" and sharding.TENSOR_AXIS in token_axes:
        # SSMB may cut a sequence across tensor ranks (they hold consecutive pieces of each
        # data x expert shard): gather the small [T, E] statistics to whole sequences first
        # (the pmean over tensor averages equal values: it only marks the loss tensor-invariant)
        scores_TE = jax.lax.all_gather(scores_TE, sharding.TENSOR_AXIS, tiled=True)
        idx_TK = jax.lax.all_gather(idx_TK, sharding.TENSOR_AXIS, tiled=True)
        rest = tuple(a for a in token_axes if a != sharding.TENSOR_AXIS)
        loss = router.load_balance_loss(scores_TE, idx_TK, cfg, seq_len, rest)
        return jax.lax.pmean(loss, sharding.TENSOR_AXIS)
    return router.load_balance_loss(scores_TE, idx_TK, cfg, seq_len, token_axes)


def routing_stats(routing: router.Routing, keep_TK, cfg: MoEConfig, seq_len, token_axes=()) -> MoEStats:
    """Step 5's routing half, reduced over `token_axes` (those of the whole batch)."""
    psum = (lambda v: jax.lax.psum(v, token_axes)) if token_axes else (lambda v: v)
    tokens_per_expert_E = psum(router.tokens_per_expert(routing.topk_idx_TK, cfg.num_experts))
    num_dropped = psum(jnp.sum(~keep_TK).astype(jnp.int32))
    num_copies = psum(jnp.asarray(keep_TK.size, jnp.int32))
    return MoEStats(
        tokens_per_expert=tokens_per_expert_E,
        num_dropped=num_dropped,
        drop_rate=num_dropped / num_copies,
        aux_loss=_balance_loss(routing, cfg, seq_len, token_axes),
        z_loss=router.z_loss(routing.logits_TE, token_axes),
    )


def _reduce_exchange(ex: ExchangeStats | None, token_axes) -> ExchangeStats | None:
    """Per-device fields become [devices] vectors (one entry per shard), the rest are summed."""
    if ex is None or not token_axes:
        return ex

    def reduce(name, value):
        if value is None:
            return None
        return value[None] if name in PER_DEVICE else jax.lax.psum(value, token_axes)

    return ExchangeStats(*(reduce(k, v) for k, v in ex._asdict().items()))


def make_body(cfg: MoEConfig, parallel: ParallelConfig, place, seq_len: int | None):
    """body(router_params, experts, x_TD[, shared]) -> (y_TD, MoEStats) for `place`
    (placement.Placement); `shared` (the shared experts' weights) when `place.shared_inside`."""
    dispatcher = DISPATCHERS[parallel.dispatch]

    def body(router_params, experts, x_TD, shared=None):
        routing, kept = route_and_keep(x_TD, router_params, cfg)
        stages = dispatcher.stages(x_TD, kept, experts, cfg, parallel, place)
        if shared is not None:
            stages = overlap.with_shared(stages, lambda: shared_experts(x_TD, shared, cfg.activation))
        y_TD, ex = run(stages)
        if place.partial_axis is not None:
            y_TD = jax.lax.psum(y_TD, place.partial_axis)
        stats = routing_stats(routing, kept.keep_TK, cfg, seq_len, place.token_axes)
        return y_TD, stats.with_exchange(_reduce_exchange(ex, place.token_axes))

    return body
