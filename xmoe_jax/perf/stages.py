"""Per-stage times (forward, and forward+backward) of a shard_map dispatch (pft, rbd), and its node-axis traffic.

Shapes: T tokens per device, K top-k, E experts, N nodes, G devices per node.

The dispatches are written as named stages (moe/stages.py) and placed by moe/placement.py. For each stage this
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

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig, ParallelConfig
from xmoe_jax.moe import placement
from xmoe_jax.moe.body import route_and_keep
from xmoe_jax.moe.dispatchers import DISPATCHERS
from xmoe_jax.moe.stages import run, run_until
from xmoe_jax.perf.timing import time_fn

ROUTE, LAYER = "route", "layer"


@functools.lru_cache(maxsize=128)
def compiled_prefix(cfg: MoEConfig, parallel: ParallelConfig, mesh, stop: str, backward: bool = False):
    """`prefix_fn` kept per (cfg, parallel, mesh, stop, backward), so skews and repeats reuse it."""
    return prefix_fn(cfg, parallel, mesh, stop, backward=backward)


def prefix_fn(
    cfg: MoEConfig, parallel: ParallelConfig, mesh, stop: str, on_stage=None, backward: bool = False
):
    """jit f(params, x_TD) -> the arrays at the end of stage `stop` (ROUTE, a dispatch stage or LAYER).

    The block is placed as the layer places it (moe/placement.py); per-device arrays come
    back concatenated over the token axes (scalars as [1]). With `backward`, f returns
    instead the gradients (params, x_TD) of sum(v**2) over the floating outputs: the
    prefix's forward and backward passes.
    """
    dispatcher = DISPATCHERS[parallel.dispatch]

    def fn(params, x_TD):
        place = placement.resolve(parallel, mesh, x_TD.shape[0], cfg)

        def body(router_params, experts, x_TD):
            routing, kept = route_and_keep(x_TD, router_params, cfg)
            if stop == ROUTE:
                out = (kept.topk_idx_TK, kept.keep_TK, kept.gate_TK)
            else:
                stages = dispatcher.stages(x_TD, kept, experts, cfg, parallel, place)
                out = (run(stages, on_stage)[0],) if stop == LAYER else run_until(stages, stop)
            return tuple(jnp.atleast_1d(v) for v in out)

        tokens = PartitionSpec(place.token_axes)
        shard = placement.shard(body, place, parallel, params["experts"], params["router"], tokens)
        return shard(params["router"], params["experts"], x_TD)

    if not backward:
        return jax.jit(fn)

    def loss(params, x_TD):
        outs = [v for v in fn(params, x_TD) if jnp.issubdtype(v.dtype, jnp.floating)]
        return sum(jnp.sum(jnp.square(v.astype(jnp.float32))) for v in outs)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def stage_names(cfg: MoEConfig, parallel: ParallelConfig, mesh, params, x_TD) -> list[str]:
    """The dispatch's stage names, in order, as it traces on `mesh` (no compilation)."""
    names: list[str] = []
    jax.eval_shape(prefix_fn(cfg, parallel, mesh, LAYER, names.append), params, x_TD)
    return names


def stage_times(
    cfg: MoEConfig, parallel: ParallelConfig, mesh, params, x_TD, iters: int = 10, backward: bool = False
) -> list[dict]:
    """[{stage, prefix_ms, stage_ms}] for ROUTE, each dispatch stage, and the rest of the layer.

    With `backward`, also prefix_fwd_bwd_ms and stage_fwd_bwd_ms (forward plus backward).
    """
    rows = []
    for stop in (ROUTE, *stage_names(cfg, parallel, mesh, params, x_TD), LAYER):
        row = {"stage": stop}
        for key, bwd in (("", False), ("_fwd_bwd", True)) if backward else (("", False),):
            t = 1e3 * time_fn(compiled_prefix(cfg, parallel, mesh, stop, bwd), params, x_TD, iters=iters)
            row[f"prefix{key}_ms"] = t
            row[f"stage{key}_ms"] = t - (rows[-1][f"prefix{key}_ms"] if rows else 0.0)
        rows.append(row)
    return rows


def node_rows(cfg: MoEConfig, parallel: ParallelConfig, mesh, params, x_TD) -> dict:
    """Rows crossing the node axis (one direction, all devices) for PFT and for RBD, same routing."""
    idx_TK, keep_TK, _ = (np.asarray(v) for v in compiled_prefix(cfg, parallel, mesh, ROUTE)(params, x_TD))
    nodes, local = sharding.expert_layout(mesh)
    node_of_shard = sharding.token_shard_nodes(mesh, placement.token_axes(parallel))
    shard_T = np.arange(idx_TK.shape[0]) // (idx_TK.shape[0] // node_of_shard.size)
    src_node_T = node_of_shard[shard_T]
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
