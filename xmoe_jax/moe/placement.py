"""Where the MoE block runs on the mesh: the block's only `jax.shard_map`.

Shapes: T tokens, D model, E experts, F expert hidden, TP tensor ranks.

| mode (ParallelConfig)         | tokens (routing, dispatch, combine)  | expert weights [E,D,F]        | how         |
|-------------------------------|--------------------------------------|-------------------------------|-------------|
| dense, padded                 | data x expert (annotation)           | E over expert                 | partitioner |
| dense, padded + ssmb          | data x expert x tensor (annotation)  | E over expert                 | partitioner |
| pft                           | data x expert, per device            | E over expert                 | shard_map   |
| pft + ssmb                    | data x expert x tensor, per device   | E over expert                 | shard_map   |
| pft + expert_tensor_parallel  | data x expert, same on every TP rank | E over expert, F over tensor; outputs psum'd over tensor | shard_map |
| pft + auto_shard              | data x expert (annotation only)      | E over expert                 | partitioner |
| rbd (+ ssmb / expert-TP)      | as pft; expert = expert_node x expert: stage 1 over expert_node, stage 2 over expert | E over both | shard_map |

Partitioner modes see the whole batch (T = all tokens) and leave placement to XLA
under the logical rules. shard_map modes run the body per device: capacity is per
source shard (T = that shard's tokens), as in X-MoE. The exchange always runs over
the expert axes, so with SSMB every (data, tensor) coordinate is its own
expert-parallel group, and the block's output comes back split over tensor too.
Statistics are reduced over every token axis, so they are those of the whole batch.

With `parallel.overlap` shared/both, a shard_map mode and `mesh.tensor == 1`, the shared
experts enter the shard_map too (weights replicated, tokens as the routed block's) and run
between the dispatch and the combine (`Placement.shared_inside`, overlap.py); otherwise they
run after the block on the caller's layout (a column/row-split MLP under TP).

`check_vma=False`: Pallas kernel outputs carry no varying-axes type on jax 0.11, so
shard_map cannot type them; with the check off it psums the cotangents of
replicated inputs (the router) itself, which is what the backward pass needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig, ParallelConfig, check_groups_by_node
from xmoe_jax.moe.dispatchers import DISPATCHERS
from xmoe_jax.moe.params import EXPERT_AXES
from xmoe_jax.moe.stats import PER_DEVICE, MoEStats


class Placement(NamedTuple):
    """How one call of the block is placed (static)."""

    mesh: Any  # Mesh or AbstractMesh; None = one device, no placement
    sharded: bool  # the body runs per device inside shard_map
    token_axes: tuple[str, ...]  # inside shard_map: the axes tokens are split over; else ()
    partial_axis: str | None  # expert-TP: the axis the expert hidden is split over (outputs psum'd)
    constrain: Callable  # logical sharding constraints for the body (a no-op inside shard_map)
    shared_inside: bool = False  # the shared experts run in the body, between dispatch and combine


def token_axes(parallel: ParallelConfig) -> tuple[str, ...]:
    """Mesh axes a shard_map dispatch splits the block's tokens over."""
    return sharding.moe_token_axes(parallel.ssmb)


def _no_constraint(x, names):
    del names
    return x


def resolve(parallel: ParallelConfig, mesh, num_tokens: int, cfg: MoEConfig) -> Placement:
    """The placement of a block call with `num_tokens` tokens; checks the token split divides."""
    sharded = mesh is not None and DISPATCHERS[parallel.dispatch].shard_map and not parallel.auto_shard
    if sharded:
        axes = token_axes(parallel)
        shards = sharding.axis_size(mesh, axes)
        if num_tokens % shards:
            raise ValueError(
                f"moe_layer: {num_tokens} tokens are not divisible by the {shards} token shards "
                f"(mesh axes {axes}{' with parallel.ssmb' if parallel.ssmb else ''}); "
                "choose a batch and sequence length whose product they divide"
            )
    if parallel.route_groups_by_node and mesh is not None:  # group g must be node g's experts here
        check_groups_by_node(cfg, sharding.expert_layout(mesh)[0])
    tp = sharding.axis_size(mesh, sharding.TENSOR_AXIS)
    if parallel.expert_tensor_parallel and cfg.expert_hidden % tp:
        raise ValueError(
            f"parallel.expert_tensor_parallel: expert_hidden={cfg.expert_hidden} is not divisible by the "
            f"{tp} tensor ranks"
        )
    if not sharded:
        constrain = block_constrainer(parallel, mesh) if mesh is not None else _no_constraint
        return Placement(mesh, False, (), None, constrain)
    partial = sharding.TENSOR_AXIS if parallel.expert_tensor_parallel else None
    # overlapped shared experts: whole (replicated) weights on the shard's tokens, so only without
    # TP; under TP they stay the caller's column/row-split MLP after the block
    inside = parallel.overlap in ("shared", "both") and cfg.num_shared_experts > 0 and tp == 1
    return Placement(mesh, True, token_axes(parallel), partial, _no_constraint, inside)


def block_constrainer(parallel: ParallelConfig, mesh):
    """Constraints by logical name under the block's activation rules (tokens over tensor with SSMB)."""
    return sharding.constrainer(mesh, sharding.activation_rules(ssmb=parallel.ssmb))


def expert_specs(experts: dict, parallel: ParallelConfig) -> dict:
    """PartitionSpecs of the expert weights: E over expert; F over tensor with expert-TP."""
    rules = sharding.param_rules(expert_tensor_parallel=parallel.expert_tensor_parallel)
    return {k: sharding.logical_to_spec(EXPERT_AXES[k], rules) for k in experts}


def place_experts(experts: dict, parallel: ParallelConfig, mesh) -> dict:
    """Sharding constraints on the expert weights for the partitioner modes."""
    rules = sharding.param_rules(expert_tensor_parallel=parallel.expert_tensor_parallel)
    return {k: sharding.constrain(v, mesh, EXPERT_AXES[k], rules) for k, v in experts.items()}


def stats_specs(parallel: ParallelConfig, axes: tuple[str, ...]) -> MoEStats:
    """out_specs of the block's statistics: totals replicated, per-device fields over `axes`."""
    fields = DISPATCHERS[parallel.dispatch].exchange_fields

    def spec(name):
        if name in MoEStats._field_defaults and name not in fields:
            return None  # not reported by this dispatch
        return PartitionSpec(axes) if name in PER_DEVICE else PartitionSpec()

    return MoEStats(*(spec(name) for name in MoEStats._fields))


def _replicated(tree):
    return jax.tree.map(lambda _: PartitionSpec(), tree)


def shard(
    body,
    place: Placement,
    parallel: ParallelConfig,
    experts: dict,
    router_params: dict,
    out_specs,
    shared: dict | None = None,
):
    """`body(router_params, experts, x_TD[, shared])` per device over the block's token axes
    (shared experts, when given, replicated)."""
    in_specs = (_replicated(router_params), expert_specs(experts, parallel), PartitionSpec(place.token_axes))
    if shared is not None:
        in_specs = (*in_specs, _replicated(shared))
    return jax.shard_map(body, mesh=place.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def run_block(body, params: dict, x_TD: jax.Array, place: Placement, parallel: ParallelConfig):
    """(y_TD, MoEStats) of the block body placed as `place` says."""
    if not place.sharded:
        experts = params["experts"]
        if place.mesh is not None:
            experts = place_experts(experts, parallel, place.mesh)
        return body(params["router"], experts, x_TD)
    out_specs = (PartitionSpec(place.token_axes), stats_specs(parallel, place.token_axes))
    shared = (params["shared"],) if place.shared_inside else ()
    fn = shard(body, place, parallel, params["experts"], params["router"], out_specs, *shared)
    return fn(params["router"], params["experts"], x_TD, *shared)
