"""The functional MoE layer: route, dispatch, run experts, combine.

Shapes: T tokens, D model, E experts, K top-k, F expert hidden.

    y_TD, aux = moe_layer(params, x_TD, cfg)             # no mesh
    y_TD, aux = moe_layer(params, x_TD, cfg, mesh=mesh)  # placed on a mesh

Steps:
  1. router logits in float32, top-k choice and combine weights (router.py);
  2. capacity: with `capacity_factor`, each expert keeps at most
     C = ceil(cf * T * k / E) copies, chosen by `drop_policy` (capacity.py);
  3. dispatch by `cfg.dispatch`, experts, combine;
  4. plus the shared experts, if any.

`dense` and `padded` see the whole batch (T = all tokens) and leave placement to
XLA's partitioner under the logical rules of xmoe_jax.sharding. `pft` runs steps
1-3 per device inside one `shard_map` over the token axes (data x expert), with
the experts split over the expert axis: its capacity is per source shard (T = that
shard's tokens), as in X-MoE. Dropless, every mode returns the same values with or
without a mesh; dropping, `pft` equals the dense oracle given the same keep mask.
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
from xmoe_jax.moe.pft import pft_dispatch

EXPERT_AXES = {
    "w_gate": ("experts", "embed", "expert_mlp"),
    "w_up": ("experts", "embed", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "embed"),
}
TOKEN_AXES = ("data", "expert")  # the mesh axes tokens are split over inside shard_map


def _place_experts(experts: dict, mesh: Mesh | None) -> dict:
    if mesh is None:
        return experts
    return {k: sharding.constrain(v, mesh, EXPERT_AXES[k], sharding.PARAM_RULES) for k, v in experts.items()}


def _route_and_keep(x_TD, router_params, cfg: MoEConfig):
    bias_E = router_params.get("bias") if cfg.has_router_bias else None
    routing = router.route(x_TD, router_params["kernel"], bias_E, cfg)
    capacity = cfg.capacity(x_TD.shape[0]) if cfg.capacity_factor is not None else None
    keep_TK, pos_TK = keep_mask(
        routing.topk_idx_TK, routing.topk_weight_TK, cfg.num_experts, capacity, cfg.drop_policy
    )
    gate_TK = jnp.where(keep_TK, routing.topk_weight_TK, 0.0)
    return routing, keep_TK, pos_TK, gate_TK, capacity


def _aux(routing: router.Routing, keep_TK, cfg: MoEConfig, seq_len, axis_names=()) -> dict:
    psum = (lambda v: jax.lax.psum(v, axis_names)) if axis_names else (lambda v: v)
    tokens_per_expert_E = psum(router.tokens_per_expert(routing.topk_idx_TK, cfg.num_experts))
    num_dropped = psum(jnp.sum(~keep_TK).astype(jnp.int32))
    num_copies = psum(jnp.asarray(keep_TK.size, jnp.int32))
    return {
        "tokens_per_expert": tokens_per_expert_E,
        "num_dropped": num_dropped,
        "drop_rate": num_dropped / num_copies,
        "aux_loss": router.load_balance_loss(
            routing.scores_TE, routing.topk_idx_TK, cfg, seq_len, axis_names
        ),
        "z_loss": router.z_loss(routing.logits_TE, axis_names),
    }


def _global_routed(params, x_TD, cfg: MoEConfig, mesh, seq_len):
    """dense / padded: the whole batch at once, placed by the partitioner."""
    constrain = sharding.constrainer(mesh)
    experts = _place_experts(params["experts"], mesh)
    routing, keep_TK, pos_TK, gate_TK, capacity = _route_and_keep(x_TD, params["router"], cfg)
    if cfg.dispatch == "dense":
        y_TD = dense_dispatch(x_TD, routing.topk_idx_TK, gate_TK, experts, cfg.activation, constrain)
    else:
        # dropless padded needs room for every token at one expert: C = T
        cap = capacity if capacity is not None else x_TD.shape[0]
        y_TD = padded_dispatch(
            x_TD, routing.topk_idx_TK, gate_TK, keep_TK, pos_TK, cap, experts, cfg.activation, constrain
        )
    return y_TD, _aux(routing, keep_TK, cfg, seq_len)


def _pft_body(cfg: MoEConfig, seq_len, axis_name, num_peers, axis_names, transport):
    def body(router_params, experts, x_TD):
        routing, keep_TK, pos_TK, gate_TK, _ = _route_and_keep(x_TD, router_params, cfg)
        y_TD, stats = pft_dispatch(
            x_TD,
            routing.topk_idx_TK,
            gate_TK,
            keep_TK,
            pos_TK,
            experts,
            cfg,
            axis_name=axis_name,
            num_peers=num_peers,
            transport=transport,
        )
        aux = _aux(routing, keep_TK, cfg, seq_len, axis_names)
        # per-device loads as [devices] vectors; totals reduced
        aux["recv_rows"] = stats["recv_rows"][None] if axis_names else stats["recv_rows"]
        aux["wire_bytes"] = stats["wire_bytes"][None] if axis_names else stats["wire_bytes"]
        overflow = stats["num_overflow"]
        aux["num_overflow"] = jax.lax.psum(overflow, axis_names) if axis_names else overflow
        return y_TD, aux

    return body


def _pft_routed(params, x_TD, cfg: MoEConfig, mesh, seq_len):
    transport = resolve_transport(cfg.transport)
    if mesh is None:
        body = _pft_body(cfg, seq_len, None, 1, (), transport)
        return body(params["router"], params["experts"], x_TD)
    body = _pft_body(cfg, seq_len, "expert", mesh.shape["expert"], TOKEN_AXES, transport)
    tokens = PartitionSpec(TOKEN_AXES)
    expert_specs = {k: PartitionSpec("expert") for k in params["experts"]}
    router_specs = jax.tree.map(lambda _: PartitionSpec(), params["router"])
    per_device = PartitionSpec(TOKEN_AXES)
    aux_specs = {
        "tokens_per_expert": PartitionSpec(),
        "num_dropped": PartitionSpec(),
        "drop_rate": PartitionSpec(),
        "aux_loss": PartitionSpec(),
        "z_loss": PartitionSpec(),
        "num_overflow": PartitionSpec(),
        "recv_rows": per_device,
        "wire_bytes": per_device,
    }
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(router_specs, expert_specs, tokens), out_specs=(tokens, aux_specs)
    )
    return fn(params["router"], params["experts"], x_TD)


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
    constrain = sharding.constrainer(mesh)
    x_TD = constrain(x_TD, ("tokens", "embed"))
    if cfg.dispatch == "pft":
        y_TD, aux = _pft_routed(params, x_TD, cfg, mesh, seq_len)
    elif cfg.dispatch in ("dense", "padded"):
        y_TD, aux = _global_routed(params, x_TD, cfg, mesh, seq_len)
    else:
        raise ValueError(f"dispatch={cfg.dispatch!r} is not implemented")
    if cfg.num_shared_experts > 0:
        y_TD = y_TD + shared_experts(x_TD, params["shared"], cfg.activation)
    return constrain(y_TD, ("tokens", "embed")), aux
