"""The one place that knows mesh axes.

Model code names tensor dimensions logically ("embed", "experts", "tokens", ...);
this module builds the mesh and maps logical names to mesh axes through two rule
tables: PARAM_RULES for parameters (and optimizer state, which follows them) and
ACTIVATION_RULES for activations. Nothing else in the package spells a mesh axis:
code that needs one (the MoE `shard_map`) asks the helpers below.

What is sharded where (`-` = replicated; TP = tensor parallelism):

| tensor                          | data      | expert   | tensor                     |
|---------------------------------|-----------|----------|----------------------------|
| tokens / batch                  | split     | split    | -                          |
| residual stream [B,S,D]         | split     | split    | S split (sequence_parallel)|
| attention heads, MLP F (TP)     | (fsdp: D) | (fsdp: D, with data) | split (column / row) |
| vocab (embed, lm head)          | (fsdp: D) | (fsdp: D, with data) | split              |
| MoE block tokens                | split     | split    | split (parallel.ssmb)      |
| expert weights [E,D,F]          | (fsdp: D) | E split  | F split (parallel.expert_tensor_parallel) |
| expert buffers [E,C,D] (padded) | -         | E split  | -                          |

Variants are chosen by config, not by editing tables: `param_rules(fsdp,
expert_tensor_parallel)` and `activation_rules(sequence_parallel, ssmb)`.

The mesh is ambient: the trainer enters `jax.set_mesh(mesh)` once, and model code
asks `current_mesh()` (None without one: one device, no placement).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xmoe_jax.config import MeshConfig, MeshShape

MESH_AXES = ("data", "expert_node", "expert", "tensor")
# the expert-parallel group is expert_node x expert (node-major); expert_node has size 1 unless
# the group spans several nodes for RBD (mesh.expert_nodes), where stage 1 runs over expert_node
# and stage 2 over expert. pft exchanges over both.
EXPERT_AXES = ("expert_node", "expert")
TENSOR_AXIS = "tensor"  # tensor parallelism; SSMB splits MoE tokens over it

# logical name -> mesh axis (or tuple of axes, or None = replicated)
PARAM_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,  # the leading axis of a layer stack
    "vocab": "tensor",
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "latent": None,  # MLA's compressed q / kv latents: small, replicated
    "mlp": "tensor",
    "experts": EXPERT_AXES,
    "expert_mlp": None,
    "router_experts": None,
    "norm": None,
}
# FSDP splits every weight's model dim over the whole data-parallel group, data x expert (the
# distributed optimizer of DeepSeek-V3 and Megatron shards over all data-parallel ranks): the
# attention, dense and shared weights are then not replicated over the expert axes, and expert
# weights, whose `experts` dim already holds the expert axes, take `data` alone (an axis is used
# once). MLA's wq_b and wkv_b have no embed dim: their latent dim is split instead.
FSDP_AXES = ("data", *EXPERT_AXES)
FSDP_PARAM_RULES = {**PARAM_RULES, "embed": FSDP_AXES, "latent": FSDP_AXES}

ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", *EXPERT_AXES),
    "tokens": ("data", *EXPERT_AXES),
    "moe_tokens": ("data", *EXPERT_AXES),  # tokens inside the MoE block (+ tensor under SSMB)
    "seq": None,
    "residual_seq": None,  # sequence dim of the residual stream (tensor under sequence parallelism)
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "latent": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "experts": EXPERT_AXES,
    "capacity": None,
}


def axis_sizes(shape: MeshShape) -> dict[str, int]:
    """Mesh axis name -> size for resolved mesh sizes."""
    return dict(
        zip(MESH_AXES, (shape.data, shape.expert_nodes, shape.expert_per_node, shape.tensor), strict=True)
    )


def mesh_shape(mesh) -> MeshShape:
    """The resolved sizes of a mesh made by `make_mesh` (or its abstract mesh)."""
    return MeshShape(*(int(mesh.shape[a]) for a in MESH_AXES))


def make_mesh(mesh_cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, expert_node, expert, tensor) mesh over `devices` (default: all), Auto axes."""
    mesh_cfg = mesh_cfg or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    sizes = axis_sizes(mesh_cfg.resolve(len(devices)))
    device_array = np.asarray(devices).reshape(tuple(sizes[a] for a in MESH_AXES))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(device_array, MESH_AXES, axis_types=axis_types)


def current_mesh():
    """The ambient mesh (`jax.set_mesh`), abstract inside jit; None when none is set."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def expert_layout(mesh) -> tuple[int, int]:
    """(nodes, devices per node) of the expert-parallel group."""
    node_axis, local_axis = EXPERT_AXES
    return mesh.shape[node_axis], mesh.shape[local_axis]


def logical_to_spec(names: Sequence[str | None], rules: dict) -> PartitionSpec:
    """PartitionSpec for logical dimension names; a mesh axis is used at most once."""
    used: set[str] = set()
    spec = []
    for name in names:
        axes = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; add it to xmoe_jax.sharding")
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes_t = tuple(a for a in axes_t if a not in used)
        used.update(axes_t)
        spec.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
    return PartitionSpec(*spec)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes]))


def _fits(mesh: Mesh, shape: Sequence[int], spec: PartitionSpec, prefix: bool = False) -> PartitionSpec:
    """Drops sharding on dimensions the mesh axes do not divide (tiny configs, odd sizes); with
    `prefix`, keeps the longest leading run of a dimension's axes that divides it instead (FSDP:
    7168 over data 32 x expert 64 = 2048 ways does not divide, over data 32 it does)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        keep = len(axes_t)
        while keep and dim % _size(mesh, axes_t[:keep]):
            keep = keep - 1 if prefix else 0
        if keep == len(axes_t):
            out.append(axes if axes_t and _size(mesh, axes_t) > 1 else None)
        else:
            kept = axes_t[:keep]
            out.append(None if _size(mesh, kept) == 1 else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def param_rules(fsdp: bool = False, expert_tensor_parallel: bool = False) -> dict:
    """Parameter rules; expert-tensor parallelism splits each expert's hidden F over `tensor`."""
    rules = FSDP_PARAM_RULES if fsdp else PARAM_RULES
    return {**rules, "expert_mlp": "tensor"} if expert_tensor_parallel else rules


def activation_rules(sequence_parallel: bool = False, ssmb: bool = False) -> dict:
    """Activation rules; SP splits the residual's sequence, SSMB the MoE block's tokens over `tensor`."""
    rules = dict(ACTIVATION_RULES)
    if sequence_parallel:
        rules["residual_seq"] = "tensor"
    if ssmb:
        rules["moe_tokens"] = moe_token_axes(ssmb=True)
    return rules


def moe_token_axes(ssmb: bool) -> tuple[str, ...]:
    """Mesh axes the MoE block's tokens are split over (major to minor): data x expert, plus tensor
    under SSMB. Every dispatch path (pft, rbd) takes its shard_map token spec from here, so the
    flat token dim of [B*S, D] sharded (data, expert) over B and tensor over S is this layout."""
    return ("data", *EXPERT_AXES, "tensor") if ssmb else ("data", *EXPERT_AXES)


def token_shard_nodes(mesh, axes: Sequence[str]) -> np.ndarray:
    """The expert node of each token shard, shards numbered row-major over `axes` (as
    PartitionSpec(axes) splits a token dimension)."""
    sizes = [mesh.shape[a] for a in axes]
    coords = np.unravel_index(np.arange(int(np.prod(sizes))), sizes)
    return np.asarray(coords[list(axes).index(EXPERT_AXES[0])])


def exchange_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The axis name(s) pft exchanges over: the expert axes of size > 1, a plain name when one."""
    axes = tuple(a for a in EXPERT_AXES if mesh.shape[a] > 1) or (EXPERT_AXES[-1],)
    return axes[0] if len(axes) == 1 else axes


def axis_size(mesh: Mesh | None, axes: str | Sequence[str]) -> int:
    """Number of devices along `axes` (1 without a mesh)."""
    if mesh is None:
        return 1
    axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes_t]))


def logical_size(mesh: Mesh | None, name: str, rules: dict = ACTIVATION_RULES) -> int:
    """Number of devices a dimension of logical name `name` is split over (1 without a mesh)."""
    axes = rules.get(name) if mesh is not None else None
    if axes is None:
        return 1
    axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
    return axis_size(mesh, [a for a in axes_t if a in mesh.shape])


def named_sharding(
    mesh: Mesh, names: Sequence[str | None], shape: Sequence[int], rules: dict, prefix: bool = False
) -> NamedSharding:
    return NamedSharding(mesh, _fits(mesh, shape, logical_to_spec(names, rules), prefix))


def tree_shardings(mesh: Mesh, abstract_tree, logical_tree, rules: dict):
    """NamedShardings for a pytree of parameters given a matching pytree of logical-name tuples
    (a dimension keeps the leading mesh axes that divide it)."""
    return jax.tree.map(
        lambda x, names: named_sharding(mesh, names, x.shape, rules, prefix=True),
        abstract_tree,
        logical_tree,
        is_leaf=lambda n: isinstance(n, tuple),
    )


def constrain(x: jax.Array, mesh: Mesh | None, names: Sequence[str | None], rules: dict = ACTIVATION_RULES):
    """with_sharding_constraint by logical names; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, names, x.shape, rules))


def constrainer(mesh: Mesh | None, rules: dict = ACTIVATION_RULES):
    """`constrain` bound to a mesh, handed to mesh-agnostic code."""
    return lambda x, names: constrain(x, mesh, names, rules)
