"""Per-layer statistics of one MoE block, as one typed structure.

Shapes: E experts, P devices of the block's token axes.

`MoEStats` is what `moe_layer` returns beside its output and what the model
collects per layer: the routing statistics every dispatch has, and the exchange
statistics only the shard_map dispatches (pft, rbd) have (None elsewhere). Totals
are those of the whole batch; the fields in `PER_DEVICE` are [P] vectors, one entry
per device of the token axes (a scalar without a mesh).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

PER_DEVICE = (
    "recv_rows",
    "wire_bytes",
    "routed_bytes",
    "peak_rows",
    "buffer_rows",
    "peak_ratio",
    "pilot_rows",
    "inter_node_rows",
    "wire_bytes_node",
    "routed_bytes_node",
    "max_nodes_per_token",
)


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

    def with_exchange(self, ex: ExchangeStats | None) -> MoEStats:
        return self if ex is None else self._replace(**ex._asdict())


def exchange_fields(ex: ExchangeStats | None) -> tuple[str, ...]:
    """The exchange fields a dispatch filled in."""
    return () if ex is None else tuple(k for k, v in ex._asdict().items() if v is not None)
