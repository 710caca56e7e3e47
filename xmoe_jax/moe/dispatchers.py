"""The dispatch modes, one table: how routed copies reach their experts and come back.

Shapes: T tokens, D model, K top-k, E experts.

Each entry turns (x_TD, kept copies, expert weights) into a stage generator
(stages.py) whose result is (y_TD, ExchangeStats or None), and says whether it runs
per device inside the block's shard_map (placement.py) or on the whole batch under
XLA's partitioner. Adding a dispatch mode means adding one entry here (and its name
to `config.Dispatch`).

| mode   | what                                                              | placement   | module     |
|--------|-------------------------------------------------------------------|-------------|------------|
| dense  | every expert on every token, masked: the numerical oracle         | partitioner | dense.py   |
| padded | capacity baseline: [E, C, D] buffers, batched experts             | partitioner | padded.py  |
| pft    | padding-free: expert-major flat buffer, ragged exchange, grouped GEMMs | shard_map | pft.py  |
| rbd    | two-stage: one pilot per (token, node) across nodes, pft inside    | shard_map   | rbd.py     |

`parallel.auto_shard` runs pft's algorithm under the partitioner instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp

from xmoe_jax import sharding
from xmoe_jax.config import MoEConfig, ParallelConfig
from xmoe_jax.moe import overlap
from xmoe_jax.moe.capacity import expert_positions
from xmoe_jax.moe.dense import dense_dispatch
from xmoe_jax.moe.padded import padded_dispatch
from xmoe_jax.moe.pft import ExchangeSpec, pair_rows, pft_stages, recv_rows
from xmoe_jax.moe.rbd import rbd_stages
from xmoe_jax.moe.stages import Stages
from xmoe_jax.moe.stats import merge_chunks
from xmoe_jax.moe.transports import choose


def _dense(x_TD, kept, experts, cfg: MoEConfig, parallel: ParallelConfig, place) -> Stages:
    y_TD = dense_dispatch(x_TD, kept.topk_idx_TK, kept.gate_TK, experts, cfg.activation, place.constrain)
    yield "experts", (y_TD,)
    return y_TD, None


def _padded(x_TD, kept, experts, cfg: MoEConfig, parallel: ParallelConfig, place) -> Stages:
    # dropless padded needs room for every token at one expert: C = T
    cap = kept.capacity if kept.capacity is not None else x_TD.shape[0]
    y_TD = padded_dispatch(
        x_TD,
        kept.topk_idx_TK,
        kept.gate_TK,
        kept.keep_TK,
        kept.pos_TK,
        cap,
        experts,
        cfg.activation,
        place.constrain,
    )
    yield "experts", (y_TD,)
    return y_TD, None


def _pft(x_TD, kept, experts, cfg: MoEConfig, parallel: ParallelConfig, place) -> Stages:
    axes = sharding.exchange_axes(place.mesh) if place.sharded else None
    peers = sharding.axis_size(place.mesh, axes) if axes else 1
    sizes = (cfg.num_experts, cfg.top_k, x_TD.shape[0], peers, kept.capacity, parallel.recv_buffer_factor)
    transport = choose(parallel.transport)  # settled at start-up (resolve.py), or the table's rule
    chunked = transport.layout == "chunked"
    mean = x_TD.shape[0] * cfg.top_k / (peers if chunked else 1)
    chunk = pair_rows(*sizes) if chunked else None
    spec = ExchangeSpec(cfg.num_experts, cfg.top_k, recv_rows(*sizes), cfg.activation, chunk, mean)
    return (
        yield from pft_stages(
            x_TD,
            kept.topk_idx_TK,
            kept.gate_TK,
            kept.keep_TK,
            kept.pos_TK,
            experts,
            spec,
            axis_name=axes,
            num_peers=peers,
            transport=transport,
            decomposed=parallel.ragged_decomposed,
        )
    )


def _rbd(x_TD, kept, experts, cfg: MoEConfig, parallel: ParallelConfig, place) -> Stages:
    if not place.sharded:  # one device: no nodes to bypass
        return (yield from _pft(x_TD, kept, experts, cfg, parallel, place))
    node_axis, local_axis = sharding.EXPERT_AXES
    num_nodes, local_size = sharding.expert_layout(place.mesh)
    return (
        yield from rbd_stages(
            x_TD,
            kept.topk_idx_TK,
            kept.gate_TK,
            kept.keep_TK,
            experts,
            cfg.num_experts,
            cfg.activation,
            node_axis=node_axis,
            local_axis=local_axis,
            num_nodes=num_nodes,
            local_size=local_size,
            transport=choose(parallel.transport),
            recv_buffer_factor=parallel.recv_buffer_factor,
            max_nodes=cfg.topk_groups if parallel.route_groups_by_node else None,
            decomposed=parallel.ragged_decomposed,
        )
    )


def _in_chunks(stages_fn):
    """`stages_fn` run on `parallel.overlap_chunks` consecutive slices of the shard's tokens.

    Each chunk is routed copies, exchange, experts and combine of its own (queue positions are
    re-ranked inside the chunk; capacity was already decided for the whole shard), so XLA may
    run one chunk's exchange while another chunk's experts compute. With `parallel.overlap`
    `chunks` or `both` the chunks are software-pipelined (overlap.py: chunk i+1's dispatch
    before chunk i's experts), else run in sequence. Outputs are concatenated; statistics
    merged as stats.FIELDS says (counts summed, peaks the max). Stage names gain a
    `chunk<i>/` prefix.
    """

    def run(x_TD, kept, experts, cfg: MoEConfig, parallel: ParallelConfig, place) -> Stages:
        num = parallel.overlap_chunks if place.sharded else 1
        if num == 1 or x_TD.shape[0] % num:
            return (yield from stages_fn(x_TD, kept, experts, cfg, parallel, place))
        size = x_TD.shape[0] // num

        def chunk_stages(i):
            part = slice(i * size, (i + 1) * size)
            idx_TK, keep_TK = kept.topk_idx_TK[part], kept.keep_TK[part]
            pos_TK = expert_positions(
                jnp.where(keep_TK, idx_TK, cfg.num_experts),
                kept.gate_TK[part],
                cfg.num_experts + 1,
                "position",
            )
            chunk = kept._replace(
                topk_idx_TK=idx_TK, gate_TK=kept.gate_TK[part], keep_TK=keep_TK, pos_TK=pos_TK
            )
            return stages_fn(x_TD[part], chunk, experts, cfg, parallel, place)

        order = overlap.pipelined if parallel.overlap in ("chunks", "both") else overlap.sequential
        results = yield from order([chunk_stages(i) for i in range(num)])
        ys, stats = zip(*results, strict=True)

        return jnp.concatenate(ys), merge_chunks(stats)

    return run


@dataclass(frozen=True)
class Dispatcher:
    """One dispatch mode: its stages, where it runs, and the exchange statistics it reports."""

    stages: Callable[..., Stages]  # (x_TD, kept, experts, cfg, parallel, place) -> Stages
    shard_map: bool  # per device inside the block's shard_map (else the whole batch, partitioner)
    exchange_fields: tuple[str, ...] = ()  # ExchangeStats fields it fills in
    # routed copies cross devices through static receive buffers (parallel.transport,
    # recv_buffer_factor and the trainer's buffer ladder apply; dropless steps can overflow)
    exchanges_tokens: bool = False


_PFT_FIELDS = (
    "num_overflow",
    "recv_rows",
    "wire_bytes",
    "routed_bytes",
    "peak_rows",
    "buffer_rows",
    "peak_ratio",
    "exchange_rows",
)
_RBD_FIELDS = (
    *_PFT_FIELDS,
    "pilot_rows",
    "inter_node_rows",
    "wire_bytes_node",
    "routed_bytes_node",
    "max_nodes_per_token",
)
DISPATCHERS: dict[str, Dispatcher] = {
    "dense": Dispatcher(_dense, shard_map=False),
    "padded": Dispatcher(_padded, shard_map=False),
    "pft": Dispatcher(_in_chunks(_pft), shard_map=True, exchange_fields=_PFT_FIELDS, exchanges_tokens=True),
    "rbd": Dispatcher(_in_chunks(_rbd), shard_map=True, exchange_fields=_RBD_FIELDS, exchanges_tokens=True),
}


def exchanges_tokens(dispatch: str) -> bool:
    """Whether dispatch mode `dispatch` moves routed copies between devices through receive buffers."""
    return DISPATCHERS[dispatch].exchanges_tokens
