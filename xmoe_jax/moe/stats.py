"""Per-layer statistics of one MoE block, as one typed structure.

Shapes: E experts, P devices of the block's token axes.

`MoEStats` is what `moe_layer` returns beside its output and what the model
collects per layer: the routing statistics every dispatch has, and the exchange
statistics only the shard_map dispatches (pft, rbd) have (None elsewhere). Totals
are those of the whole batch; the fields in `PER_DEVICE` are [P] vectors, one entry
per device of the token axes (a scalar without a mesh). `FIELDS` says, per field, how
it combines across devices, overlap chunks and micro-batches; the block body, its
shard_map specs, the chunked dispatch and the train step's accumulation all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Merge = Literal["sum", "mean", "max"]


@dataclass(frozen=True)
class Field:
    """How one statistic combines: across the devices of the token axes, across the overlap
    chunks of one device's shard (moe/dispatchers.py), across the micro-batches of one step
    (train/step.py)."""

    per_device: bool  # a [P] vector, one entry per device; else a total of the whole batch
    chunks: Merge | None  # None: computed once per shard (the routing half), never per chunk
    micro: Merge


# One row per MoEStats field; every reducer reads this table.
FIELDS: dict[str, Field] = {
    "tokens_per_expert": Field(per_device=False, chunks=None, micro="sum"),
    "num_dropped": Field(per_device=False, chunks=None, micro="sum"),
    "drop_rate": Field(per_device=False, chunks=None, micro="mean"),
    "aux_loss": Field(per_device=False, chunks=None, micro="mean"),
    "z_loss": Field(per_device=False, chunks=None, micro="mean"),
    "num_overflow": Field(per_device=False, chunks="sum", micro="sum"),
    "recv_rows": Field(per_device=True, chunks="sum", micro="sum"),
    "wire_bytes": Field(per_device=True, chunks="sum", micro="sum"),
    "routed_bytes": Field(per_device=True, chunks="sum", micro="sum"),
    # buffer peaks: the binding one (a step fits when every chunk and micro-batch fits)
    "peak_rows": Field(per_device=True, chunks="max", micro="max"),
    "buffer_rows": Field(per_device=True, chunks="max", micro="max"),
    "peak_ratio": Field(per_device=True, chunks="max", micro="max"),
    "pilot_rows": Field(per_device=True, chunks="sum", micro="sum"),
    "inter_node_rows": Field(per_device=True, chunks="sum", micro="sum"),
    "wire_bytes_node": Field(per_device=True, chunks="sum", micro="sum"),
    "routed_bytes_node": Field(per_device=True, chunks="sum", micro="sum"),
    "max_nodes_per_token": Field(per_device=True, chunks="max", micro="max"),
    # [P, P] routed rows from expert-axis rank s to rank d, summed over the batch's shards
    "exchange_rows": Field(per_device=False, chunks="sum", micro="sum"),
}
PER_DEVICE = tuple(name for name, field in FIELDS.items() if field.per_device)


class ExchangeStats(NamedTuple):
    """What a dispatch reports about its exchange, per device (inside the block's shard_map)."""

    num_overflow: jax.Array  # copies that did not fit a receive buffer (dropless: must stay 0)
    recv_rows: jax.Array  # rows this device's experts received
    wire_bytes: jax.Array  # bytes the transport put on the wire from this device (dispatch + combine)
    routed_bytes: jax.Array  # bytes the routing needed to send off this device (dispatch + combine)
    peak_rows: jax.Array  # rows the binding buffer had to hold (a total or one source's chunk)
    buffer_rows: jax.Array  # that buffer's static rows: the step fits when peak_rows <= buffer_rows
    peak_ratio: jax.Array  # peak_rows over the average (the buffer factor that would just fit)
    pilot_rows: jax.Array | None = None  # rbd: pilots this device sent (one per token and node)
    inter_node_rows: jax.Array | None = None  # rbd: of those, rows that left the node
    wire_bytes_node: jax.Array | None = None  # rbd: bytes on the node axis (stage 1, both ways)
    routed_bytes_node: jax.Array | None = None  # rbd: pilot bytes stage 1 needed (both ways)
    max_nodes_per_token: jax.Array | None = None  # rbd: most nodes one of this device's tokens reached
    exchange_rows: jax.Array | None = None  # [P, P]: row `me` holds the rows routed to each peer


class MoEStats(NamedTuple):
    """Statistics of one MoE layer (whole batch unless the field is in PER_DEVICE)."""

    tokens_per_expert: jax.Array  # [E] int32 routed copies per expert, before any drop
    num_dropped: jax.Array  # copies dropped by capacity
    drop_rate: jax.Array  # num_dropped / routed copies
    aux_loss: jax.Array  # load-balance loss
    z_loss: jax.Array  # router z-loss
    num_overflow: jax.Array | None = None
    recv_rows: jax.Array | None = None
    wire_bytes: jax.Array | None = None
    routed_bytes: jax.Array | None = None
    peak_rows: jax.Array | None = None
    buffer_rows: jax.Array | None = None
    peak_ratio: jax.Array | None = None
    pilot_rows: jax.Array | None = None
    inter_node_rows: jax.Array | None = None
    wire_bytes_node: jax.Array | None = None
    routed_bytes_node: jax.Array | None = None
    max_nodes_per_token: jax.Array | None = None
    exchange_rows: jax.Array | None = None

    def with_exchange(self, ex: ExchangeStats | None) -> MoEStats:
        return self if ex is None else self._replace(**ex._asdict())


def exchange_matrix(topk_idx_TK, keep_TK, num_experts: int, num_peers: int, me) -> jax.Array:
    """[P, P] int32 whose row `me` counts the kept copies this device routes to each peer of the
    exchange axis (rows it keeps on the diagonal); summed over the token axes (body.py) it is the
    batch's source x destination matrix, the input of `exchange_bound_ratio` (train/metrics.py)."""
    dest_TK = topk_idx_TK // (num_experts // num_peers)
    row_P = jnp.zeros((num_peers,), jnp.int32).at[dest_TK].add(keep_TK.astype(jnp.int32))
    return jnp.zeros((num_peers, num_peers), jnp.int32).at[me].set(row_P)


def merge_chunks(parts: list[ExchangeStats]) -> ExchangeStats:
    """The exchange statistics of one shard from those of its overlap chunks (FIELDS[..].chunks)."""

    def merge(name, *values):
        if values[0] is None:
            return None
        return jnp.max(jnp.stack(values), 0) if FIELDS[name].chunks == "max" else sum(values)

    return ExchangeStats(
        *(merge(n, *vs) for n, vs in zip(ExchangeStats._fields, zip(*parts, strict=True), strict=True))
    )


_REDUCE_N = {"sum": lambda v: v.sum(0), "mean": lambda v: v.mean(0), "max": lambda v: v.max(0)}


def merge_micro(stats_N: MoEStats) -> MoEStats:
    """The statistics of one step from those of its N micro-batches ([N, ...] leaves)."""
    return MoEStats(
        *(
            None if v is None else _REDUCE_N[FIELDS[name].micro](v)
            for name, v in zip(MoEStats._fields, stats_N, strict=True)
        )
    )
