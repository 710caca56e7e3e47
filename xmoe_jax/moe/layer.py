"""The functional MoE layer: route, dispatch, run experts, combine.

Shapes: T tokens, D model, E experts, K top-k, F expert hidden, TP tensor ranks.

    y_TD, aux = moe_layer(params, x_TD, cfg)             # no mesh
    y_TD, aux = moe_layer(params, x_TD, cfg, mesh=mesh)  # placed on a mesh

Steps:
  1. router logits in float32, top-k choice and combine weights (router.py);
  2. capacity: with `capacity_factor`, each expert keeps at most
     C = ceil(cf * T * k / E) copies, chosen by `drop_policy` (capacity.py);
  3. dispatch by `cfg.dispatch`, experts, combine;
  4. plus the shared experts, if any (on the block's input as given: under tensor
     parallelism they are an ordinary column/row-split MLP).

Placement (what is sharded where; the mesh axes come from xmoe_jax.sharding):

| mode                       | tokens (routing, dispatch, combine) | expert weights [E,D,F] | how           |
|----------------------------|-------------------------------------|------------------------|---------------|
| dense, padded              | data x expert                       | E over expert          | partitioner   |
| pft                        | data x expert (per-device shard_map)| E over expert          | shard_map     |
| pft + ssmb                 | data x expert x tensor              | E over expert          | shard_map     |
| pft + expert_tensor_parallel | data x expert, same on every TP rank | E over expert, F over tensor; partial outputs psum'd over tensor | shard_map |
| pft + auto_shard           | data x expert (annotation only)     | E over expert          | partitioner   |
| dense, padded + ssmb       | data x expert x tensor (annotation) | E over expert          | partitioner   |

`dense` and `padded` see the whole batch (T = all tokens) and leave placement to
XLA's partitioner under the logical rules. `pft` runs steps 1-3 per device inside
one `shard_map` over the MoE token axes, with the experts split over the expert
axis: its capacity is per source shard (T = that shard's tokens), as in X-MoE.
The exchange always runs over the expert axis, so with SSMB every (data, tensor)
coordinate is its own expert-parallel group, and the block's output comes back
split over tensor too (the caller all-gathers it, or keeps it sequence-sharded).
Aux statistics are reduced over every token axis, so they are those of the whole
batch. Dropless, every mode returns the same values with or without a mesh;
dropping, `pft` equals the dense oracle given the same keep mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig
from xmoe_jax.moe import router
from xmoe_jax.moe.capacity import keep_mask
from xmoe_jax.moe.dense import dense_dispatch
from xmoe_jax.moe.exchange import resolve_transport
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.moe.padded import padded_dispatch
from xmoe_jax.moe.pft import pft_stages
from xmoe_jax.moe.rbd import rbd_stages
from xmoe_jax.moe.stages import run

EXPERT_AXES = {
    "w_gate": ("experts", "embed", "expert_mlp"),
    "w_up": ("experts", "embed", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "embed"),
}
TOKEN_AXES = sharding.moe_token_axes(ssmb=False)  # pft without SSMB (kept for benchmarks)


def token_axes(cfg: MoEConfig) -> tuple[str, ...]:
    """Mesh axes a shard_map dispatch (pft, rbd) splits the block's tokens over."""
    return sharding.moe_token_axes(cfg.ssmb)


def expert_specs(experts: dict, cfg: MoEConfig) -> dict:
    """shard_map specs of the expert weights: E over expert; F over tensor with expert-TP."""
    rules = sharding.param_rules(expert_tensor_parallel=cfg.expert_tensor_parallel)
    return {k: sharding.logical_to_spec(EXPERT_AXES[k], rules) for k in experts}


def _place_experts(experts: dict, cfg: MoEConfig, mesh: Mesh | None) -> dict:
    if mesh is None:
        return experts
    rules = sharding.param_rules(expert_tensor_parallel=cfg.expert_tensor_parallel)
    return {k: sharding.constrain(v, mesh, EXPERT_AXES[k], rules) for k, v in experts.items()}


def _check_divisible(x_TD, cfg: MoEConfig, mesh: Mesh | None) -> None:
    """shard_map needs whole token shards (the partitioner paths replicate what does not divide)."""
    shards = sharding.axis_size(mesh, token_axes(cfg))
    if cfg.dispatch in ("pft", "rbd") and not cfg.auto_shard and x_TD.shape[0] % shards:
        raise ValueError(
            f"moe_layer: {x_TD.shape[0]} tokens are not divisible by the {shards} token shards "
            f"(mesh axes {token_axes(cfg)}{' with moe.ssmb' if cfg.ssmb else ''}); "
            "choose a batch and sequence length whose product they divide"
        )
    tp = sharding.axis_size(mesh, sharding.TENSOR_AXIS)
    if cfg.expert_tensor_parallel and cfg.expert_hidden % tp:
        raise ValueError(
            f"moe.expert_tensor_parallel: expert_hidden={cfg.expert_hidden} is not divisible by the "
            f"{tp} tensor ranks"
        )


def route_and_keep(x_TD, router_params, cfg: MoEConfig):
    """Routing, then capacity: (routing, keep_TK, pos_TK, gate_TK, capacity or None)."""
    bias_E = router_params.get("bias") if cfg.has_router_bias else None
    routing = router.route(x_TD, router_params["kernel"], bias_E, cfg)
    capacity = cfg.capacity(x_TD.shape[0]) if cfg.capacity_factor is not None else None
    keep_TK, pos_TK = keep_mask(
        routing.topk_idx_TK, routing.topk_weight_TK, cfg.num_experts, capacity, cfg.drop_policy
    )
    gate_TK = jnp.where(keep_TK, routing.topk_weight_TK, 0.0)
    return routing, keep_TK, pos_TK, gate_TK, capacity


def _balance_loss(routing: router.Routing, cfg: MoEConfig, seq_len, axis_names) -> jax.Array:
    scores_TE, idx_TK = routing.scores_TE, routing.topk_idx_TK
    if cfg.aux_loss_type == "sequence" and sharding.TENSOR_AXIS in axis_names:
        # SSMB may cut a sequence across tensor ranks (they hold consecutive pieces of each
        # data x expert shard): gather the small [T, E] statistics to whole sequences first
        # (the pmean over tensor averages equal values: it only marks the loss tensor-invariant)
        scores_TE = jax.lax.all_gather(scores_TE, sharding.TENSOR_AXIS, tiled=True)
        idx_TK = jax.lax.all_gather(idx_TK, sharding.TENSOR_AXIS, tiled=True)
        rest = tuple(a for a in axis_names if a != sharding.TENSOR_AXIS)
        loss = router.load_balance_loss(scores_TE, idx_TK, cfg, seq_len, rest)
        return jax.lax.pmean(loss, sharding.TENSOR_AXIS)
    return router.load_balance_loss(scores_TE, idx_TK, cfg, seq_len, axis_names)


def _aux(routing: router.Routing, keep_TK, cfg: MoEConfig, seq_len, axis_names=()) -> dict:
    psum = (lambda v: jax.lax.psum(v, axis_names)) if axis_names else (lambda v: v)
    tokens_per_expert_E = psum(router.tokens_per_expert(routing.topk_idx_TK, cfg.num_experts))
    num_dropped = psum(jnp.sum(~keep_TK).astype(jnp.int32))
    num_copies = psum(jnp.asarray(keep_TK.size, jnp.int32))
    return {
        "tokens_per_expert": tokens_per_expert_E,
        "num_dropped": num_dropped,
        "drop_rate": num_dropped / num_copies,
        "aux_loss": _balance_loss(routing, cfg, seq_len, axis_names),
        "z_loss": router.z_loss(routing.logits_TE, axis_names),
    }


def _global_routed(params, x_TD, cfg: MoEConfig, mesh, seq_len):
    """dense / padded / pft + auto_shard: the whole batch at once, placed by the partitioner."""
    constrain = sharding.constrainer(mesh, sharding.activation_rules(ssmb=cfg.ssmb))
    experts = _place_experts(params["experts"], cfg, mesh)
    if cfg.dispatch == "pft":  # the padding-free algorithm as one device would run it
        dispatch = dispatch_stages(cfg, None, resolve_transport(cfg.transport))
        return _sharded_body(cfg, seq_len, dispatch, ())(params["router"], experts, x_TD)
    routing, keep_TK, pos_TK, gate_TK, capacity = route_and_keep(x_TD, params["router"], cfg)
    if cfg.dispatch == "dense":
        y_TD = dense_dispatch(x_TD, routing.topk_idx_TK, gate_TK, experts, cfg.activation, constrain)
    else:
        # dropless padded needs room for every token at one expert: C = T
        cap = capacity if capacity is not None else x_TD.shape[0]
        y_TD = padded_dispatch(
            x_TD, routing.topk_idx_TK, gate_TK, keep_TK, pos_TK, cap, experts, cfg.activation, constrain
        )
    return y_TD, _aux(routing, keep_TK, cfg, seq_len)


PER_DEVICE_STATS = ("recv_rows", "wire_bytes", "pilot_rows", "inter_node_rows", "wire_bytes_node")


def _sharded_body(cfg: MoEConfig, seq_len, dispatch, axis_names, partial_axis=None):
    """Per-device layer: route and keep locally, then run `dispatch`'s stages (pft or rbd).

    `partial_axis`: the experts are F-split over it (expert-TP), so y is summed over it.
    Statistics named in PER_DEVICE_STATS come back as [devices] vectors, the rest summed.
    """

    def body(router_params, experts, x_TD):
        routing, keep_TK, pos_TK, gate_TK, _ = route_and_keep(x_TD, router_params, cfg)
        y_TD, stats = run(dispatch(x_TD, routing.topk_idx_TK, gate_TK, keep_TK, pos_TK, experts))
        if partial_axis is not None:
            y_TD = jax.lax.psum(y_TD, partial_axis)
        aux = _aux(routing, keep_TK, cfg, seq_len, axis_names)
        for key, value in stats.items():
            if key in PER_DEVICE_STATS:
                aux[key] = value[None] if axis_names else value
            else:
                aux[key] = jax.lax.psum(value, axis_names) if axis_names else value
        return y_TD, aux

    return body


def dispatch_stages(cfg: MoEConfig, mesh: Mesh | None, transport: str):
    """The per-device dispatch of `cfg.dispatch` on `mesh` (one device without one), as stages.

    Returns f(x_TD, idx_TK, gate_TK, keep_TK, pos_TK, experts) -> a stage generator
    (stages.py) whose result is (y_TD, stats).
    """
    if mesh is None or cfg.dispatch == "pft" or cfg.auto_shard:
        axes = None if mesh is None or cfg.auto_shard else sharding.exchange_axes(mesh)
        peers = sharding.axis_size(mesh, axes) if axes else 1

        def run_pft(x_TD, idx_TK, gate_TK, keep_TK, pos_TK, experts):
            return pft_stages(
                x_TD,
                idx_TK,
                gate_TK,
                keep_TK,
                pos_TK,
                experts,
                cfg,
                axis_name=axes,
                num_peers=peers,
                transport=transport,
            )

        return run_pft
    node_axis, local_axis = sharding.EXPERT_AXES

    def run_rbd(x_TD, idx_TK, gate_TK, keep_TK, pos_TK, experts):
        del pos_TK  # rbd ranks copies per node itself
        return rbd_stages(
            x_TD,
            idx_TK,
            gate_TK,
            keep_TK,
            experts,
            cfg,
            node_axis=node_axis,
            local_axis=local_axis,
            num_nodes=mesh.shape[node_axis],
            local_size=mesh.shape[local_axis],
            transport=transport,
        )

    return run_rbd


def aux_specs(axes: tuple[str, ...], stat_keys) -> dict:
    """shard_map out_specs of the aux dict: totals replicated, per-device loads over `axes`."""
    totals = ("tokens_per_expert", "num_dropped", "drop_rate", "aux_loss", "z_loss")
    specs = {k: PartitionSpec() for k in totals}
    for key in stat_keys:
        specs[key] = PartitionSpec(axes) if key in PER_DEVICE_STATS else PartitionSpec()
    return specs


def _sharded_routed(params, x_TD, cfg: MoEConfig, mesh, seq_len):
    """pft / rbd: one shard_map over the MoE token axes, experts over the expert axes."""
    transport = resolve_transport(cfg.transport)
    dispatch = dispatch_stages(cfg, mesh, transport)
    if mesh is None:
        return _sharded_body(cfg, seq_len, dispatch, ())(params["router"], params["experts"], x_TD)
    axes = token_axes(cfg)
    partial = sharding.TENSOR_AXIS if cfg.expert_tensor_parallel else None
    body = _sharded_body(cfg, seq_len, dispatch, axes, partial)
    tokens = PartitionSpec(axes)
    router_specs = jax.tree.map(lambda _: PartitionSpec(), params["router"])
    stat_keys = _stat_keys(cfg)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(router_specs, expert_specs(params["experts"], cfg), tokens),
        out_specs=(tokens, aux_specs(axes, stat_keys)),
        # Pallas kernel outputs carry no varying-axes type on jax 0.11; shard_map then psums
        # the cotangents of replicated inputs itself
        check_vma=False,
    )
    return fn(params["router"], params["experts"], x_TD)


def _stat_keys(cfg: MoEConfig) -> tuple[str, ...]:
    pft_keys = ("recv_rows", "wire_bytes", "num_overflow")
    if cfg.dispatch == "rbd":
        return (*pft_keys, "pilot_rows", "inter_node_rows", "wire_bytes_node")
    return pft_keys


def moe_layer(
    params: dict, x_TD: jax.Array, cfg: MoEConfig, mesh: Mesh | None = None, *, seq_len: int | None = None
) -> tuple[jax.Array, dict]:
    """Routed (plus shared) experts applied to a flat batch of tokens.

    Args:
      params: {"router": {"kernel" [D,E], "bias" [E] (sigmoid)}, "experts": {...},
        optional "shared": {...}} as documented in the README.
      x_TD: tokens; compute runs in x's dtype, routing in float32.
      cfg: the MoE config (`cfg.dispatch` picks the dispatch path).
      mesh: optional mesh from `xmoe_jax.sharding.make_mesh`.
      seq_len: tokens per sequence, for the sequence-wise balance loss.

    Returns:
      y_TD and aux: tokens_per_expert [E] (before drops), num_dropped, drop_rate,
      aux_loss, z_loss; `pft` adds num_overflow (copies that did not fit a receive
      buffer: non-zero only with a small recv_buffer_factor), recv_rows and
      wire_bytes (per device).
    """
    _check_divisible(x_TD, cfg, mesh)
    constrain = sharding.constrainer(mesh, sharding.activation_rules(ssmb=cfg.ssmb))
    # routed experts: the tokens over data x expert, plus tensor under SSMB (1/TP per tensor rank);
    # a sequence-parallel input is already laid out so, a TP-replicated one is sliced for free
    xr_TD = constrain(x_TD, ("moe_tokens", "embed"))
    if cfg.dispatch in ("pft", "rbd") and not cfg.auto_shard:
        y_TD, aux = _sharded_routed(params, xr_TD, cfg, mesh, seq_len)
    elif cfg.dispatch in ("dense", "padded", "pft"):
        y_TD, aux = _global_routed(params, xr_TD, cfg, mesh, seq_len)
    else:
        raise ValueError(f"dispatch={cfg.dispatch!r} is not implemented")
    y_TD = constrain(y_TD, ("moe_tokens", "embed"))
    if cfg.num_shared_experts > 0:  # a TP (column/row) MLP on the input as the caller laid it out
        y_TD = y_TD + shared_experts(x_TD, params["shared"], cfg.activation)
    # under SSMB the output stays split over tensor: the caller gathers it (or keeps it under SP)
    return constrain(y_TD, ("moe_tokens", "embed")), aux
