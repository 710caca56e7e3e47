"""Functional MoE core: `moe_layer(params, x_TD, cfg, mesh=None)`."""

from xmoe_jax.moe.layer import moe_layer
from xmoe_jax.moe.params import init_moe_params

__all__ = ["moe_layer", "init_moe_params"]
