"""Flax module around the functional `moe_layer`.

The block's variables are exactly `moe_layer`'s parameter tree (moe/params.py: one
initialiser, one set of logical axis names): router.kernel [D,E], router.bias [E]
(sigmoid routing; a `RouterBias` variable, not a `Param`, so the optimizer never
touches it), experts.w_gate/w_up [E,D,F], experts.w_down [E,F,D], and the shared
experts. Shapes: B batch, S sequence, D model, E experts, F expert hidden.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from xmoe_jax.config import ModelConfig, ParallelConfig
from xmoe_jax.model.layers import dtypes
from xmoe_jax.moe.layer import moe_layer
from xmoe_jax.moe.params import init_moe_params, logical_axes
from xmoe_jax.moe.stats import MoEStats


class RouterBias(nnx.Variable):
    """Selection-only correction bias, updated by the aux-loss-free rule, not by gradients."""


def _variables(values: dict, logical: dict, path: tuple = ()) -> nnx.Dict:
    out = {}
    for name, value in values.items():
        if isinstance(value, dict):
            out[name] = _variables(value, logical[name], (*path, name))
        else:
            kind = RouterBias if (*path, name) == ("router", "bias") else nnx.Param
            out[name] = kind(value, logical=logical[name])
    return nnx.Dict(out)


def _values(tree: nnx.Dict) -> dict:
    return {k: _values(v) if isinstance(v, nnx.Dict) else v[...] for k, v in tree.items()}


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, parallel: ParallelConfig | None = None):
        moe = cfg.moe
        self.cfg = moe
        self.parallel = parallel or ParallelConfig()
        _, pdt = dtypes(cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        values = init_moe_params(rngs.params, cfg.hidden, moe, cfg.init_std, pdt, out_std)
        logical = logical_axes(moe)
        for name, sub in values.items():  # router, experts, shared: the moe_layer tree
            setattr(self, name, _variables(sub, logical[name], (name,)))

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, MoEStats]:
        b, s, d = x_BSD.shape
        params = {
            name: _values(getattr(self, name))
            for name in ("router", "experts", "shared")
            if hasattr(self, name)
        }
        y_TD, stats = moe_layer(params, x_BSD.reshape(b * s, d), self.cfg, self.parallel, seq_len=s)
        return y_TD.reshape(b, s, d), stats
