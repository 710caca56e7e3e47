"""The functional MoE layer: route, dispatch, run experts, combine.

Shapes: T tokens, D model, E experts, K top-k.

    y_TD, stats = moe_layer(params, x_TD, cfg)                       # one device, dense oracle
    y_TD, stats = moe_layer(params, x_TD, cfg, ParallelConfig())     # pft (auto) on the ambient mesh

`cfg` (MoEConfig) says what the layer computes; `parallel` (ParallelConfig) how it is
placed: the dispatch mode and its exchange (dispatchers.py) and where each piece runs
(placement.py, with its table). The mesh is the ambient one (`jax.set_mesh`) unless
one is passed. Steps (body.py): route and keep in float32, dispatch, experts and
combine; then the shared experts, if any, on the block's input as the caller laid it
out (under tensor parallelism an ordinary column/row-split MLP), or, with
`parallel.overlap` shared/both and no TP, inside the block between the dispatch and
the combine exchanges (placement.py, overlap.py).

Dropless, every dispatch mode returns the same values with or without a mesh;
dropping, pft and rbd equal the dense oracle given the same keep mask.
"""

from __future__ import annotations

import jax

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig, ParallelConfig
from xmoe_jax.moe import placement
from xmoe_jax.moe.body import make_body
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.moe.stats import MoEStats

DEFAULT_PARALLEL = ParallelConfig(dispatch="dense")  # the oracle, by name: tests call the layer bare


def moe_layer(
    params: dict,
    x_TD: jax.Array,
    cfg: MoEConfig,
    parallel: ParallelConfig = DEFAULT_PARALLEL,
    *,
    mesh=None,
    seq_len: int | None = None,
) -> tuple[jax.Array, MoEStats]:
    """Routed (plus shared) experts applied to a flat batch of tokens.

    Args:
      params: the tree of moe/params.py ({"router", "experts", optional "shared"}).
      x_TD: tokens; compute runs in x's dtype, routing in float32.
      cfg: the MoE config (experts, router, capacity, losses).
      parallel: dispatch mode and placement; the default is the dense oracle (`auto`: pft).
      mesh: a mesh from `xmoe_jax.sharding.make_mesh`; default the ambient one (or none).
      seq_len: tokens per sequence, for the sequence-wise balance loss.

    Returns:
      y_TD and MoEStats (moe/stats.py): loads before drops, drops, balance and z losses,
      and for pft/rbd the exchange's overflow, received rows and wire bytes.
    """
    parallel = parallel.settle(has_experts=True)  # a placement passed bare: auto is pft
    mesh = mesh if mesh is not None else sharding.current_mesh()
    place = placement.resolve(parallel, mesh, x_TD.shape[0], cfg)
    constrain = placement.block_constrainer(parallel, mesh)
    # routed experts: the tokens over data x expert, plus tensor under SSMB (1/TP per tensor rank);
    # a sequence-parallel input is already laid out so, a TP-replicated one is sliced for free
    xr_TD = constrain(x_TD, ("moe_tokens", "embed"))
    body = make_body(cfg, parallel, place, seq_len)
    y_TD, stats = placement.run_block(body, params, xr_TD, place, parallel)
    y_TD = constrain(y_TD, ("moe_tokens", "embed"))
    if cfg.num_shared_experts > 0 and not place.shared_inside:  # a TP (column/row) MLP on the caller's layout
        y_TD = y_TD + shared_experts(x_TD, params["shared"], cfg.activation)
    # under SSMB the output stays split over tensor: the caller gathers it (or keeps it under SP)
    return constrain(y_TD, ("moe_tokens", "embed")), stats
