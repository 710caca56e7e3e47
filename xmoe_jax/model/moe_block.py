"""Flax module around the functional `moe_layer`.

The module owns the parameters (with logical axis names) and hands `moe_layer` the
documented pytree: router.kernel [D,E], router.bias [E] (sigmoid routing; a
`RouterBias` variable, not a `Param`, so the optimizer never touches it),
experts.w_gate/w_up [E,D,F], experts.w_down [E,F,D], and the shared experts.
Shapes: B batch, S sequence, D model, E experts, F expert hidden.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from xmoe_jax.config import ModelConfig
from xmoe_jax.model.layers import MLP, dtypes, param
from xmoe_jax.moe.layer import EXPERT_AXES, moe_layer


class RouterBias(nnx.Variable):
    """Selection-only correction bias, updated by the aux-loss-free rule, not by gradients."""


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        e = cfg.moe.num_experts
        self.kernel = param(rngs, (cfg.hidden, e), ("embed", "router_experts"), cfg.init_std, pdt)
        if cfg.moe.has_router_bias:
            self.bias = RouterBias(jnp.zeros((e,), jnp.float32), logical=("router_experts",))


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        moe = cfg.moe
        e, d, f = moe.num_experts, cfg.hidden, moe.expert_hidden
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        if moe.activation == "swiglu":
            self.w_gate = param(rngs, (e, d, f), EXPERT_AXES["w_gate"], std, pdt)
        self.w_up = param(rngs, (e, d, f), EXPERT_AXES["w_up"], std, pdt)
        self.w_down = param(rngs, (e, f, d), EXPERT_AXES["w_down"], out_std, pdt)


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        moe = cfg.moe
        self.cfg = moe
        self.router = Router(cfg, rngs)
        self.experts = Experts(cfg, rngs)
        if moe.num_shared_experts > 0:
            self.shared = MLP(cfg.hidden, moe.shared_hidden, moe.activation, cfg, rngs)
            if moe.shared_expert_gate:
                _, pdt = dtypes(cfg)
                self.shared_gate = param(rngs, (cfg.hidden, 1), ("embed", None), cfg.init_std, pdt)

    def layer_params(self) -> dict:
        """The functional pytree `moe_layer` takes."""
        router = {"kernel": self.router.kernel[...]}
        if self.cfg.has_router_bias:
            router["bias"] = self.router.bias[...]
        names = ("w_gate", "w_up", "w_down") if self.cfg.activation == "swiglu" else ("w_up", "w_down")
        params = {"router": router, "experts": {n: getattr(self.experts, n)[...] for n in names}}
        if self.cfg.num_shared_experts > 0:
            params["shared"] = self.shared.weights()
            if self.cfg.shared_expert_gate:
                params["shared"]["gate"] = self.shared_gate[...]
        return params

    def __call__(self, x_BSD: jax.Array, mesh: Mesh | None = None) -> tuple[jax.Array, dict]:
        b, s, d = x_BSD.shape
        y_TD, aux = moe_layer(self.layer_params(), x_BSD.reshape(b * s, d), self.cfg, mesh, seq_len=s)
        return y_TD.reshape(b, s, d), aux
