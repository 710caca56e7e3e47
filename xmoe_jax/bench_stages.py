"""Per-stage times (forward, and forward+backward) of a shard_map dispatch (pft, rbd), and its node-axis traffic.

Shapes: T tokens per device, K top-k, E experts, N nodes, G devices per node.

The dispatches are written as named stages (moe/stages.py). For each stage this
compiles the layer's forward up to that stage's end (a prefix: routing first, the
whole layer last), times every prefix, and reports a stage's time as the difference
of consecutive prefixes; with `backward`, the same for each prefix's gradient. Differences of medians can come out slightly negative for
stages far shorter than the run-to-run noise; they are reported as measured.

`node_rows` counts, from the routing itself, the rows that cross the node axis:
PFT sends every kept copy whose expert sits on another node; RBD sends one pilot
per distinct (token, other node). Both directions (dispatch and combine) carry the
same rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from xmoe_jax.benchmarking import time_fn
from xmoe_jax.config import MoEConfig
from xmoe_jax.moe.exchange import resolve_transport
from xmoe_jax.moe.layer import dispatch_stages, expert_specs, route_and_keep, token_axes
from xmoe_jax.moe.stages import run, run_until
from xmoe_jax.sharding import axis_size

ROUTE, LAYER = "route", "layer"


@functools.lru_cache(maxsize=128)
def compiled_prefix(cfg: MoEConfig, mesh, stop: str, backward: bool = False):
    """`prefix_fn` kept per (cfg, mesh, stop, backward), so skews and repeats reuse its compilation."""
    return prefix_fn(cfg, mesh, stop, backward=backward)


def prefix_fn(cfg: MoEConfig, mesh, stop: str, on_stage=None, backward: bool = False):
    """jit f(params, x_TD) -> the arrays at the end of stage `stop` (ROUTE, a dispatch stage or LAYER).

    Per-device arrays come back concatenated over the token axes (scalars as [1]). With
    `backward`, f returns instead the gradients (params, x_TD) of sum(v**2) over the floating
    outputs: the prefix's forward and backward passes.
    """
    stages_of = dispatch_stages(cfg, mesh, resolve_transport(cfg.transport))
    axes = token_axes(cfg)

    def body(router_params, experts, x_TD):
        routing, keep_TK, pos_TK, gate_TK, _ = route_and_keep(x_TD, router_params, cfg)
        if stop == ROUTE:
            out = (routing.topk_idx_TK, keep_TK, gate_TK)
        else:
            stages = stages_of(x_TD, routing.topk_idx_TK, gate_TK, keep_TK, pos_TK, experts)
            out = (run(stages, on_stage)[0],) if stop == LAYER else run_until(stages, stop)
        return tuple(jnp.atleast_1d(v) for v in out)

    def fn(params, x_TD):
        router_specs = jax.tree.map(lambda _: PartitionSpec(), params["router"])
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(router_specs, expert_specs(params["experts"], cfg), PartitionSpec(axes)),
            out_specs=PartitionSpec(axes),
            check_vma=False,  # Pallas outputs carry no varying-axes type (as in the layer)
        )(params["router"], params["experts"], x_TD)

    if not backward:
        return jax.jit(fn)

    def loss(params, x_TD):
        outs = [v for v in fn(params, x_TD) if jnp.issubdtype(v.dtype, jnp.floating)]
        return sum(jnp.sum(jnp.square(v.astype(jnp.float32))) for v in outs)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def stage_names(cfg: MoEConfig, mesh, params, x_TD) -> list[str]:
    """The dispatch's stage names, in order, as it traces on `mesh` (no compilation)."""
    names: list[str] = []
    jax.eval_shape(prefix_fn(cfg, mesh, LAYER, names.append), params, x_TD)
    return names


def stage_times(cfg: MoEConfig, mesh, params, x_TD, iters: int = 10, backward: bool = False) -> list[dict]:
    """[{stage, prefix_ms, stage_ms}] for ROUTE, each dispatch stage, and the rest of the layer.

    With `backward`, also prefix_fwd_bwd_ms and stage_fwd_bwd_ms (forward plus backward).
    """
    rows = []
    for stop in (ROUTE, *stage_names(cfg, mesh, params, x_TD), LAYER):
        row = {"stage": stop}
        for key, bwd in (("", False), ("_fwd_bwd", True)) if backward else (("", False),):
            t = 1e3 * time_fn(compiled_prefix(cfg, mesh, stop, bwd), params, x_TD, iters=iters)
            row[f"prefix{key}_ms"] = t
            row[f"stage{key}_ms"] = t - (rows[-1][f"prefix{key}_ms"] if rows else 0.0)
        rows.append(row)
    return rows


def node_rows(cfg: MoEConfig, mesh, params, x_TD) -> dict:
    """Rows crossing the node axis (one direction, all devices) for PFT and for RBD, same routing."""
    idx_TK, keep_TK, _ = (np.asarray(v) for v in compiled_prefix(cfg, mesh, ROUTE)(params, x_TD))
    nodes, local = mesh.shape["expert_node"], mesh.shape["expert"]
    axes = token_axes(cfg)
    shard_T = np.arange(idx_TK.shape[0]) // (idx_TK.shape[0] // axis_size(mesh, axes))
    coords = np.unravel_index(shard_T, [mesh.shape[a] for a in axes])  # shards are row-major in axes
    src_node_T = coords[axes.index("expert_node")]
    node_TK = idx_TK // (cfg.num_experts // nodes)
    off_TK = keep_TK & (node_TK != src_node_T[:, None])
    pairs = {(t, node_TK[t, k]) for t, k in zip(*np.nonzero(off_TK), strict=True)}
    row_bytes = x_TD.shape[1] * x_TD.dtype.itemsize
    pft, rbd = int(off_TK.sum()), len(pairs)
    return {
        "nodes": nodes,
        "gpus_per_node": local,
        "kept_copies": int(keep_TK.sum()),
        "pft_node_rows": pft,
        "rbd_node_rows": rbd,
        # dispatch + combine, summed over devices
        "pft_node_bytes": 2 * pft * row_bytes,
        "rbd_node_bytes": 2 * rbd * row_bytes,
    }
