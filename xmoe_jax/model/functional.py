"""The model as pure functions over plain pytrees, for jit, sharding and checkpoints.

`model_spec(cfg)` builds the module abstractly (no memory) and records its graph,
parameter shapes and logical axis names; `init_params` materialises the weights
directly in their sharded layout; `apply` merges a pytree back into the module and
runs it on the ambient mesh. Trainable weights (`Param`) and the router's selection
bias (`RouterBias`) are separate pytrees, so the optimizer only ever sees the former.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from xmoe_jax import sharding
from xmoe_jax.config import ModelConfig, ParallelConfig
from xmoe_jax.model.moe_block import RouterBias
from xmoe_jax.model.transformer import Transformer


@dataclass(frozen=True)
class ModelSpec:
    cfg: ModelConfig
    parallel: ParallelConfig
    graphdef: Any
    params_shape: dict  # pure pytree of ShapeDtypeStruct
    bias_shape: dict
    params_logical: dict  # same structure, tuples of logical axis names
    bias_logical: dict


def _nested(state: nnx.State, leaf_fn) -> dict:
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf_fn(var)
    return out


def _logical(var: nnx.Variable) -> tuple:
    """The variable's logical names; a layer stack's leading axis is "layers"."""
    names = var.get_metadata().get("logical")
    ndim = len(var.get_value().shape)
    if names is None:
        return (None,) * ndim
    return ("layers",) * (ndim - len(names)) + tuple(names)


def _shape(var: nnx.Variable) -> jax.ShapeDtypeStruct:
    v = var.get_value()
    return jax.ShapeDtypeStruct(v.shape, v.dtype)


def model_spec(cfg: ModelConfig, parallel: ParallelConfig | None = None) -> ModelSpec:
    parallel = (parallel or ParallelConfig()).settle(has_experts=cfg.moe is not None)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), parallel))
    graphdef, params, bias = nnx.split(abstract, nnx.Param, RouterBias)
    return ModelSpec(
        cfg=cfg,
        parallel=parallel,
        graphdef=graphdef,
        params_shape=_nested(params, _shape),
        bias_shape=_nested(bias, _shape),
        params_logical=_nested(params, _logical),
        bias_logical=_nested(bias, _logical),
    )


def shardings(spec: ModelSpec, mesh: Mesh, fsdp: bool = False) -> tuple[Any, Any]:
    """NamedShardings of (params, bias) under the parameter rules (expert-TP from the placement)."""
    rules = sharding.param_rules(fsdp, expert_tensor_parallel=spec.parallel.expert_tensor_parallel)
    return (
        sharding.tree_shardings(mesh, spec.params_shape, spec.params_logical, rules),
        sharding.tree_shardings(mesh, spec.bias_shape, spec.bias_logical, rules),
    )


def init_params(spec: ModelSpec, key: jax.Array, mesh: Mesh | None = None, fsdp: bool = False):
    """(params, bias) pure pytrees; created already sharded when a mesh is given."""

    def init(key):
        model = Transformer(spec.cfg, nnx.Rngs(params=key), spec.parallel)
        _, params, bias = nnx.split(model, nnx.Param, RouterBias)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(bias)

    out_shardings = shardings(spec, mesh, fsdp) if mesh is not None else None
    return jax.jit(init, out_shardings=out_shardings)(key)


def apply(spec: ModelSpec, params: dict, bias: dict, tokens_BS: jax.Array):
    """Float32 logits [B,S,V] and the MoE statistics keyed by module path (evaluation, tests)."""
    model = nnx.merge(spec.graphdef, params, bias)
    h_BSD, stats = model(tokens_BS)
    return model.logits(h_BSD), stats


def loss(spec: ModelSpec, params: dict, bias: dict, inputs_BS: jax.Array, targets_BS: jax.Array):
    """Mean next-token cross-entropy (chunked: no [B,S,V] logits) and the MoE statistics."""
    model = nnx.merge(spec.graphdef, params, bias)
    h_BSD, stats = model(inputs_BS)
    return model.loss(h_BSD, targets_BS), stats


def loss_terms(spec: ModelSpec, params: dict, bias: dict, inputs_BS: jax.Array, targets_BS: jax.Array):
    """(cross-entropy, multi-token prediction loss (0 without `model.mtp_depth`), MoE statistics of
    every MoE block, MTP modules included): the terms of the training loss (train/step.py)."""
    model = nnx.merge(spec.graphdef, params, bias)
    h_BSD, stats = model(inputs_BS)
    ce = model.loss(h_BSD, targets_BS)
    if not spec.cfg.mtp_depth:
        return ce, jnp.zeros((), jnp.float32), stats
    mtp, mtp_stats = model.mtp_loss(h_BSD, targets_BS)
    return ce, mtp, {**stats, **mtp_stats}


def decode(spec: ModelSpec, params: dict, bias: dict, tokens_BT: jax.Array, cache):
    """Float32 logits [B,V] of the last of T new tokens per row, written into and attending to
    the KV cache (model/kv_cache.py), and the updated cache (generation: prefill and decode)."""
    model = nnx.merge(spec.graphdef, params, bias)
    h_BTD, cache = model.decode(tokens_BT, cache)
    return model.logits(h_BTD[:, -1:])[:, 0], cache
