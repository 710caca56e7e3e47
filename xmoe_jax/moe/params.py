"""The MoE layer's parameter pytree: its one initialiser and its logical axis names.

Shapes: D model, E experts, F expert hidden, Fs shared-expert hidden.

    {"router":  {"kernel" [D,E], "bias" [E] (sigmoid routing only)},
     "experts": {"w_gate" [E,D,F] (SwiGLU only), "w_up" [E,D,F], "w_down" [E,F,D]},
     "shared":  {"w_gate" [D,Fs] (SwiGLU), "w_up" [D,Fs], "w_down" [Fs,D], "gate" [D,1] (gated)}}

`moe_layer` takes this tree; the Flax `MoEBlock` holds exactly this tree as its
variables (made by `init_moe_params`, named by `logical_axes`), so the model, the
functional layer and the tests share one layout and one initialiser. Weights are
normal(std) in the order router, experts (gate, up, down), shared (gate, up, down,
gate scalar); output projections (`w_down`) use `out_std`. The router bias starts at zero.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from xmoe_jax.config import MoEConfig

EXPERT_AXES = {
    "w_gate": ("experts", "embed", "expert_mlp"),
    "w_up": ("experts", "embed", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "embed"),
}
SHARED_AXES = {
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "gate": ("embed", None),
}
ROUTER_AXES = {"kernel": ("embed", "router_experts"), "bias": ("router_experts",)}


def _mlp_names(activation: str) -> tuple[str, ...]:
    return ("w_gate", "w_up", "w_down") if activation == "swiglu" else ("w_up", "w_down")


def logical_axes(cfg: MoEConfig) -> dict:
    """The same tree as `init_moe_params` gives, with tuples of logical axis names as leaves."""
    router = {"kernel": ROUTER_AXES["kernel"]}
    if cfg.has_router_bias:
        router["bias"] = ROUTER_AXES["bias"]
    tree = {"router": router, "experts": {n: EXPERT_AXES[n] for n in _mlp_names(cfg.activation)}}
    if cfg.num_shared_experts > 0:
        shared = {n: SHARED_AXES[n] for n in _mlp_names(cfg.activation)}
        if cfg.shared_expert_gate:
            shared["gate"] = SHARED_AXES["gate"]
        tree["shared"] = shared
    return tree


def _key_source(key: jax.Array | Callable[[], jax.Array]) -> Callable[[], jax.Array]:
    if callable(key):
        return key
    keys = iter(jax.random.split(key, 8))
    return lambda: next(keys)


def init_moe_params(
    key: jax.Array | Callable[[], jax.Array],
    dim: int,
    cfg: MoEConfig,
    std: float = 0.02,
    dtype=jnp.float32,
    out_std: float | None = None,
) -> dict:
    """The parameter tree above with normal(std) weights (`out_std` for `w_down`), zero bias.

    `key` is a PRNG key, or a callable returning a fresh key per weight (a Flax `Rngs`
    stream), drawn in the documented order.
    """
    next_key = _key_source(key)
    out_std = std if out_std is None else out_std

    def normal(shape, scale=std):
        return (scale * jax.random.normal(next_key(), shape)).astype(dtype)

    num_e, hid = cfg.num_experts, cfg.expert_hidden
    router = {"kernel": normal((dim, num_e))}
    if cfg.has_router_bias:
        router["bias"] = jnp.zeros((num_e,), jnp.float32)
    experts = {}
    if cfg.activation == "swiglu":
        experts["w_gate"] = normal((num_e, dim, hid))
    experts["w_up"] = normal((num_e, dim, hid))
    experts["w_down"] = normal((num_e, hid, dim), out_std)
    params = {"router": router, "experts": experts}
    if cfg.num_shared_experts > 0:
        fs = cfg.shared_hidden
        shared = {}
        if cfg.activation == "swiglu":
            shared["w_gate"] = normal((dim, fs))
        shared["w_up"] = normal((dim, fs))
        shared["w_down"] = normal((fs, dim), out_std)
        if cfg.shared_expert_gate:
            shared["gate"] = normal((dim, 1))
        params["shared"] = shared
    return params
