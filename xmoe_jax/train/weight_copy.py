"""The weights in the compute dtype, kept beside the float32 masters (`train.weight_copy`).

The model casts most of its matrices to the compute dtype (model.dtype) at every use: the expert,
shared-expert and MLP projections, attention's, MTP's and the LM head. With the copy, the optimizer
step that writes a new master also writes its cast (2 more bytes per parameter, in the same pass),
and the next step's forward and backward read the copy. So the step itself no longer
  - casts them (a 4-byte read and a 2-byte write per parameter, and XLA keeps the casts live from
    the forward pass to the backward),
  - nor turns their gradients to float32 (the GEMMs write them in the compute dtype; the norm and
    the update read those 2 bytes and widen them in registers, instead of 4 bytes written and read).
The arithmetic is the same casts, made one step earlier: the step is bit for bit the one without
the copy (tests/test_weight_copy.py). benchmarks/train_step.md has what it saves.

Not copied (the model uses them in float32, or their gradient sums in float32): the embedding (a
scatter-add gradient), the router kernel, the shared experts' gate, norm scales and biases, and the LM
head under MTP (two uses, whose gradients would be summed in the compute dtype).

One device only. On a mesh of several, a weight's gradient is summed across devices (data parallel,
or a weight replicated over the expert axis) where the weight enters the sharded computation, in its
dtype there: the copy's, bf16, where the master's cast inside the computation sums in float32
(tests/test_weight_copy.py shows the difference on 8 CPU devices). Widening a copy's gradient would
have to happen inside every shard_map, at each cast; not done. No copy
under FP8 (its quantization reads the masters) or when the params are in the compute dtype already.

Checkpoints never hold the copy (`TrainState.as_dict`): init and restore make it from the params.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from xmoe_jax.config import Config

# leaf names of the matrices the model casts to model.dtype at every use, and only casts
COPIED = frozenset({"w_up", "w_gate", "w_down", "wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b"})
COPIED |= {"lm_head", "eh_proj"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The copies a run keeps: their dtype and the leaf names copied."""

    dtype: Any
    names: frozenset


def plan(cfg: Config, devices: int) -> Plan | None:
    """The run's copies on a mesh of `devices`, or None: switched off, FP8, params in the compute dtype
    already, or several devices. The LM head is left out under MTP: its two uses' gradients would be
    summed in the copy's dtype."""
    model = cfg.model
    if not cfg.train.weight_copy or model.fp8 is not None or devices > 1:
        return None
    if jnp.dtype(model.dtype) == jnp.dtype(model.param_dtype):
        return None
    names = COPIED - {"lm_head"} if model.mtp_depth else COPIED
    return Plan(jnp.dtype(model.dtype), frozenset(names))


def leaf_name(path: tuple) -> str:
    """A param leaf's own name (its last key): what the copies and the optimizer's decay mask go by."""
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key)))


def copies(params, copy: Plan | None) -> Any:
    """The copies of `params` (arrays, or ShapeDtypeStructs: their shapes), None leaves where none."""
    if copy is None:
        return None

    def one(path, p):
        if leaf_name(path) not in copy.names:
            return None
        if isinstance(p, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(p.shape, copy.dtype, sharding=p.sharding)
        return p.astype(copy.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def shardings(params_sh, params_shape, copy: Plan | None) -> Any:
    """The copies' shardings: their masters'."""
    if copy is None:
        return None
    return jax.tree_util.tree_map_with_path(
        lambda path, _, sh: sh if leaf_name(path) in copy.names else None, params_shape, params_sh
    )


def merged(params, weights) -> Any:
    """What the model reads: each copied leaf's copy, every other leaf's master."""
    if weights is None:
        return params
    return jax.tree.map(lambda p, w: p if w is None else w, params, weights, is_leaf=lambda x: x is None)


def refreshed(params, weights) -> Any:
    """New copies of `params` where `weights` has one (the same dtypes)."""
    if weights is None:
        return None
    return jax.tree.map(
        lambda p, w: None if w is None else p.astype(w.dtype), params, weights, is_leaf=lambda x: x is None
    )


def widened(grads, params) -> Any:
    """Gradients in their masters' dtypes (a copied leaf's gradient comes in the compute dtype)."""
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
