"""HuggingFace tensor names <-> our parameter leaves, through a table of `Rule`s.

Shapes: L layers of a stack, E experts, D model, V vocab; "unit" = one HF tensor's worth
of one of our leaves (a layer's, or a (layer, expert)'s slice, or the whole leaf).

A rule says which HF tensor fills each unit of one of our leaves and how:

    Rule("params/moe_layers/attn/wq", "model.layers.{layer}.self_attn.q_proj.weight", linear(1))

`{layer}` makes the leaf's first axis the layer (HF layer = the stack's offset + index: dense
layers from 0, MoE layers after them, multi-token prediction modules after all L layers, as
DeepSeek-V3's checkpoint numbers them), `{expert}` the next axis the expert. Transforms are exact (transposes and reshapes only):
  linear(n)  a torch Linear weight [out, in]: unit = w.T reshaped, `in` = the unit's first n dims
  FLAT       a vector: unit = w reshaped (norm scales, biases, a [H*K] norm as [H,K])
  SAME       the same shape (the embedding)
`fused` names where recent transformers keep all experts of a layer in one tensor
([E, 2F, D] gate_up / [E, D, F] down, `half` 0 = gate, 1 = up); import reads either layout,
export writes the per-expert one, which is what `save_pretrained` writes (transformers 5.23).

Import builds each leaf with `jax.make_array_from_callback`: every device's shard is read
from the files as the units it covers (a slice of the embedding / head, the experts it
holds), so no device and no host holds the whole model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import numpy as np

from xmoe_jax.errors import EXIT_BAD_INPUT, XmoeError
from xmoe_jax.hf.safetensors_io import Reader

SAME, FLAT = "same", "flat"


def layer_offsets(num_dense: int, num_layers: int) -> dict[str, int]:
    """The HF layer index of each stack's first layer."""
    return {"dense_layers": 0, "moe_layers": num_dense, "mtp_layers": num_layers}


def linear(num_in: int) -> str:
    return f"linear{num_in}"


@dataclass(frozen=True)
class Fused:
    """All experts of a layer in one HF tensor: [E, ...], `half` of its dim 1 (None = all)."""

    key: str
    half: int | None = None


@dataclass(frozen=True)
class Rule:
    ours: str  # "params/<path>" or "bias/<path>"
    hf: str  # key template with {layer} / {expert}
    transform: str
    fused: Fused | None = None

    @property
    def num_stacked(self) -> int:
        return ("{layer}" in self.hf) + ("{expert}" in self.hf)


class ConversionError(XmoeError, ValueError):
    """A checkpoint cannot be converted; the message names the tensor or config key and the fix."""

    exit_code = EXIT_BAD_INPUT


def flat_leaves(tree: dict, prefix: str) -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        out.update(flat_leaves(value, path) if isinstance(value, dict) else {path: value})
    return out


def nest(flat: dict[str, object], prefix: str) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        if not path.startswith(prefix + "/"):
            continue
        *parents, leaf = path[len(prefix) + 1 :].split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _unit_keys(rule: Rule, shape: tuple, offsets: dict) -> Iterator[tuple[tuple[int, ...], str]]:
    """(unit index, HF key) of every unit of the leaf; `offsets` from `layer_offsets`."""
    offset = offsets.get(rule.ours.split("/")[1], 0)
    for unit in np.ndindex(*shape[: rule.num_stacked]):
        names = {}
        if "{layer}" in rule.hf:
            names["layer"] = offset + unit[0]
        if "{expert}" in rule.hf:
            names["expert"] = unit[-1]
        yield unit, rule.hf.format(**names)


def _to_unit(w: np.ndarray, transform: str, unit_shape: tuple) -> np.ndarray:
    if transform.startswith("linear"):
        return w.T.reshape(unit_shape)
    return w.reshape(unit_shape)


def _from_unit(u: np.ndarray, transform: str) -> np.ndarray:
    if transform.startswith("linear"):
        num_in = int(transform[len("linear") :])
        return u.reshape(math.prod(u.shape[:num_in]), -1).T
    return u.reshape(-1) if transform == FLAT else u


def _hf_layer(key: str) -> int:
    return int(key.split(".layers.")[1].split(".")[0])


def _fused_key(rule: Rule, key: str) -> str | None:
    return rule.fused.key.format(layer=_hf_layer(key)) if rule.fused is not None else None


def check_keys(reader: Reader, rules: list[Rule], shapes: dict, offsets: dict, ignored=()) -> None:
    """Every tensor the rules need is there (per expert or fused), and no tensor is left over."""
    need = {key: r for r in rules for _, key in _unit_keys(r, shapes[r.ours].shape, offsets)}
    have = reader.keys()
    missing = [k for k, r in need.items() if k not in have and _fused_key(r, k) not in have]
    if missing:
        raise ConversionError(
            f"{reader.directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
            "the checkpoint does not match its config.json"
        )
    _check_shapes(reader, need, shapes)
    used = need.keys() | {_fused_key(r, k) for k, r in need.items()}
    extra = sorted(k for k in have - used if not k.endswith(tuple(ignored)))
    if extra:
        raise ConversionError(
            f"{reader.directory}: tensor {extra[0]!r} ({len(extra)} in all) has no place in the converted "
            "model (a feature xmoe_jax does not implement); refusing rather than dropping it"
        )


def _hf_shape(transform: str, unit_shape: tuple) -> tuple[int, ...]:
    """The HF tensor's shape for one unit (what `_from_unit` writes): [out, in] for a Linear."""
    if transform.startswith("linear"):
        num_in = int(transform[len("linear") :])
        return (math.prod(unit_shape[num_in:]), math.prod(unit_shape[:num_in]))
    return (math.prod(unit_shape),) if transform == FLAT else tuple(unit_shape)


def _check_shapes(reader: Reader, need: dict[str, Rule], shapes: dict) -> None:
    """Every tensor has the shape config.json's model needs (a fused one: [E, out, in], gate and up
    stacked on out); else the file, the tensor and both shapes (reshaping would garble or fail)."""
    seen: set[str] = set()
    for key, rule in need.items():
        leaf_shape = tuple(shapes[rule.ours].shape)
        want = _hf_shape(rule.transform, leaf_shape[rule.num_stacked :])
        if key not in reader:
            key = _fused_key(rule, key)
            want = (leaf_shape[1], want[0] * (1 if rule.fused.half is None else 2), want[1])
        if key in seen:
            continue
        seen.add(key)
        got = reader.shape(key)
        if (math.prod(got) != math.prod(want)) if rule.transform == FLAT else (got != want):
            raise ConversionError(
                f"{reader.file_of(key)}: tensor {key!r} has shape {list(got)} where the model of its "
                f"config.json needs {list(want)}; the weights do not match their config.json (download "
                "both from the same release)"
            )


def _read_unit(
    reader: Reader, rule: Rule, key: str, expert: int, unit_shape: tuple, tail: tuple
) -> np.ndarray:
    """One unit of our leaf, sliced to `tail` (the shard's index over the unit's dims)."""
    if key not in reader and rule.fused is not None:
        w = reader.read(_fused_key(rule, key), (expert,))  # this expert's [2F, D] / [D, F]
        if rule.fused.half is not None:
            w = np.split(w, 2, axis=0)[rule.fused.half]
        return _to_unit(w, rule.transform, unit_shape)[tail]
    if rule.transform == SAME:
        return reader.read(key, tail)
    if rule.transform == linear(1) and len(unit_shape) == 2:  # only the shard's block, transposed
        return reader.read(key, (tail[1], tail[0])).T
    return _to_unit(reader.read(key), rule.transform, unit_shape)[tail]


def load_leaf(reader: Reader, rule: Rule, target: jax.ShapeDtypeStruct, offsets: dict) -> jax.Array:
    """Our leaf, placed with `target.sharding`, each device's shard read unit by unit."""
    stacked = rule.num_stacked
    unit_shape = tuple(target.shape[stacked:])
    keys = dict(_unit_keys(rule, target.shape, offsets))
    memo: dict[str, np.ndarray] = {}  # devices holding the same shard read it once

    def shard(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(target.shape) - len(index))
        if repr(index) not in memo:
            head, tail = index[:stacked], index[stacked:]
            ranges = [range(*s.indices(n)) for s, n in zip(head, target.shape, strict=False)]
            units = [
                _read_unit(reader, rule, keys[u], u[-1] if u else 0, unit_shape, tail).astype(target.dtype)
                for u in itertools.product(*ranges)
            ]
            block = units[0] if not stacked else np.stack(units)
            memo[repr(index)] = block.reshape(*(len(r) for r in ranges), *units[0].shape)
        return memo[repr(index)]

    return jax.make_array_from_callback(target.shape, target.sharding, shard)


def export_tensors(
    rules: list[Rule], leaves: dict[str, jax.Array], offsets: dict, dtype=None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF key, array) per unit, per-expert layout; reads one layer of a leaf from the devices at a time."""
    for rule in rules:
        leaf = leaves[rule.ours]
        units = list(_unit_keys(rule, leaf.shape, offsets))
        layer_cache: dict[int, np.ndarray] = {}
        for unit, key in units:
            if rule.num_stacked:
                if unit[0] not in layer_cache:
                    layer_cache.clear()
                    layer_cache[unit[0]] = np.asarray(leaf[unit[0]])
                block = layer_cache[unit[0]][unit[1:]] if len(unit) > 1 else layer_cache[unit[0]]
            else:
                block = np.asarray(leaf)
            out = _from_unit(block, rule.transform)
            yield key, np.ascontiguousarray(out.astype(dtype) if dtype is not None else out)
