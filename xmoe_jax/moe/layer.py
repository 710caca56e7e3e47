"""The functional MoE layer: route, dispatch, run experts, combine.

Shapes: T tokens, D model, E experts, K top-k, F expert hidden.

    y_TD, aux = moe_layer(params, x_TD, cfg)             # no mesh
    y_TD, aux = moe_layer(params, x_TD, cfg, mesh=mesh)  # placed on a mesh

Steps:
  1. router logits in float32, top-k choice and combine weights (router.py);
  2. capacity: with `capacity_factor`, each expert keeps at most
     C = ceil(cf * T * k / E) copies, chosen by `drop_policy` (capacity.py);
  3. dispatch by `cfg.dispatch` (dense oracle or padded baseline), experts, combine;
  4. plus the shared experts, if any.
With a mesh, tokens and expert weights are placed by the logical rules in
xmoe_jax.sharding and XLA partitions the rest; the values are the same as without.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig
from xmoe_jax.moe import router
from xmoe_jax.moe.capacity import keep_mask
from xmoe_jax.moe.dense import dense_dispatch
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.moe.padded import padded_dispatch

EXPERT_AXES = {
    "w_gate": ("experts", "embed", "expert_mlp"),
    "w_up": ("experts", "embed", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "embed"),
}


def _place_experts(experts: dict, mesh: Mesh | None) -> dict:
    if mesh is None:
        return experts
    return {k: sharding.constrain(v, mesh, EXPERT_AXES[k], sharding.PARAM_RULES) for k, v in experts.items()}


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
      y_TD and aux: tokens_per_expert [E] (before drops), num_dropped, aux_loss,
      z_loss, drop_rate.
    """
    constrain = sharding.constrainer(mesh)
    x_TD = constrain(x_TD, ("tokens", "embed"))
    num_tokens = x_TD.shape[0]
    experts = _place_experts(params["experts"], mesh)
    bias_E = params["router"].get("bias") if cfg.has_router_bias else None
    routing = router.route(x_TD, params["router"]["kernel"], bias_E, cfg)

    capacity = cfg.capacity(num_tokens) if cfg.capacity_factor is not None else None
    keep_TK, pos_TK = keep_mask(
        routing.topk_idx_TK, routing.topk_weight_TK, cfg.num_experts, capacity, cfg.drop_policy
    )
    gate_TK = jnp.where(keep_TK, routing.topk_weight_TK, 0.0)

    if cfg.dispatch == "dense":
        y_TD = dense_dispatch(x_TD, routing.topk_idx_TK, gate_TK, experts, cfg.activation, constrain)
    elif cfg.dispatch == "padded":
        # dropless padded needs room for every token at one expert: C = T
        cap = capacity if capacity is not None else num_tokens
        y_TD = padded_dispatch(
            x_TD, routing.topk_idx_TK, gate_TK, keep_TK, pos_TK, cap, experts, cfg.activation, constrain
        )
    else:
        raise ValueError(f"dispatch={cfg.dispatch!r} is not implemented")

    if cfg.num_shared_experts > 0:
        y_TD = y_TD + shared_experts(x_TD, params["shared"], cfg.activation)
    y_TD = constrain(y_TD, ("tokens", "embed"))

    tokens_per_expert_E = router.tokens_per_expert(routing.topk_idx_TK, cfg.num_experts)
    num_dropped = jnp.sum(~keep_TK).astype(jnp.int32)
    aux = {
        "tokens_per_expert": tokens_per_expert_E,
        "num_dropped": num_dropped,
        "drop_rate": num_dropped / keep_TK.size,
        "aux_loss": router.load_balance_loss(routing.scores_TE, routing.topk_idx_TK, cfg, seq_len),
        "z_loss": router.z_loss(routing.logits_TE),
    }
    return y_TD, aux
