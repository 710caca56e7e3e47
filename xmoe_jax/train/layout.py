"""Checkpoints written before layer stacks: per-layer trees read into the stacked layout.

Until the model ran its layers as a scan, every layer had its own subtree,
`layers/layer_007/...`; now the dense and MoE layers are two stacks,
`dense_layers/...` and `moe_layers/...`, each leaf with a leading [L] axis (layer i is
dense_layers[i] for i < num_dense_layers, else moe_layers[i - num_dense_layers]).
Parameters, router biases and every optimizer moment (which mirror the parameters) are
dicts of this shape, so one pair of tree transforms converts them all:

  per_layer_target(abstract_state, num_dense)  the stacked restore target as the old
      layout (each layer's leaf the stack's leaf without its first axis, sharded alike);
  stack_per_layer(restored, num_dense)         the restored old tree in the stacked layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

STACKS = ("dense_layers", "moe_layers")
OLD_KEY = "layers"


def is_per_layer(saved_paths) -> bool:
    """Whether saved leaf paths ("params/layers/layer_000/...") are the per-layer layout."""
    return any(f"/{OLD_KEY}/layer_" in f"/{p}" for p in saved_paths)


def _layer_slice(x, index: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
    return x[index]


def _convert(tree: Any, node_fn) -> Any:
    """Applies node_fn to every dict of the tree (inside NamedTuples and lists too), bottom-up."""
    if isinstance(tree, dict):
        return node_fn({k: _convert(v, node_fn) for k, v in tree.items()})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_convert(v, node_fn) for v in tree))
    if isinstance(tree, list | tuple):
        return type(tree)(_convert(v, node_fn) for v in tree)
    return tree


def per_layer_target(tree: Any, num_dense: int) -> Any:
    def unstack(node: dict) -> dict:
        if not any(k in node for k in STACKS):
            return node
        out = {k: v for k, v in node.items() if k not in STACKS}
        layers = {}
        for offset, name in ((0, "dense_layers"), (num_dense, "moe_layers")):
            if name not in node:
                continue
            stack = node[name]
            size = jax.tree.leaves(stack)[0].shape[0]
            for j in range(size):
                layers[f"layer_{offset + j:03d}"] = jax.tree.map(lambda x, j=j: _layer_slice(x, j), stack)
        out[OLD_KEY] = layers
        return out

    return _convert(tree, unstack)


def stack_per_layer(tree: Any, num_dense: int) -> Any:
    def stack(node: dict) -> dict:
        if OLD_KEY not in node or not isinstance(node[OLD_KEY], dict):
            return node
        layers = node[OLD_KEY]
        if not all(k.startswith("layer_") for k in layers):
            return node
        out = {k: v for k, v in node.items() if k != OLD_KEY}
        index = {int(k.split("_")[1]): k for k in layers}  # the model's layer number
        dense = [index[i] for i in sorted(index) if i < num_dense]
        moe = [index[i] for i in sorted(index) if i >= num_dense]  # a tree may hold only MoE layers (bias)
        for name, picked in (("dense_layers", dense), ("moe_layers", moe)):
            if picked:
                out[name] = jax.tree.map(lambda *a: jnp.stack(a), *(layers[n] for n in picked))
        return out

    return _convert(tree, stack)
