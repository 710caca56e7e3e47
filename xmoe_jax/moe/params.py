"""Initialisation of the functional MoE parameter pytree (used by tests and benchmarks).

The Flax model creates the same tree through its own modules; this is the
mesh-free, module-free version for callers of `moe_layer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.config import MoEConfig


def init_moe_params(key: jax.Array, dim: int, cfg: MoEConfig, std: float = 0.02, dtype=jnp.float32) -> dict:
    """{"router", "experts", optional "shared"} with normal(std) weights, zero bias."""
    keys = iter(jax.random.split(key, 8))

    def normal(shape):
        return (std * jax.random.normal(next(keys), shape)).astype(dtype)

    num_e, hid = cfg.num_experts, cfg.expert_hidden
    router = {"kernel": normal((dim, num_e))}
    if cfg.has_router_bias:
        router["bias"] = jnp.zeros((num_e,), jnp.float32)
    experts = {"w_up": normal((num_e, dim, hid)), "w_down": normal((num_e, hid, dim))}
    if cfg.activation == "swiglu":
        experts["w_gate"] = normal((num_e, dim, hid))
    params = {"router": router, "experts": experts}
    if cfg.num_shared_experts > 0:
        fs = cfg.shared_hidden
        shared = {"w_up": normal((dim, fs)), "w_down": normal((fs, dim))}
        if cfg.activation == "swiglu":
            shared["w_gate"] = normal((dim, fs))
        if cfg.shared_expert_gate:
            shared["gate"] = normal((dim, 1))
        params["shared"] = shared
    return params
