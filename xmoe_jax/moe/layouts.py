"""Where pft's routed rows sit in the send and receive buffers, and how they move.

Shapes: T local tokens, K top-k, P peers, E = P*L experts, L local experts, D model,
A = T*K compact send rows, M compact receive rows, C rows per (source, destination)
chunk.

Every device knows every device's per-expert counts ([P, E], one small all-gather), so
both layouts decide on device, identically everywhere, which copies fit and where every
row goes. A copy that does not fit is not sent: it is counted (`num_overflow`) and
contributes zero (a dropless trainer then reruns the step with bigger buffers).

compact  (transports `exact`, `ragged`, `emulated`, `push`): the send buffer is expert-major
         [A, D]; each destination has a static M-row receive buffer, whose rows fit in
         (source, local expert) order; one ragged exchange (exchange.py) moves exactly the rows
         that fit. The binding limit is the total a destination receives. Where they land is
         the transport's `arrival` (transports.arrival): `source`, one update per peer, so
         a receiver holds segments in (source, local expert) order and the experts read them
         through an index; `expert`, one update per (peer, local expert), so a receiver holds
         them grouped by local expert (sources in order within each) and the experts' grouped
         GEMMs read and write them in place (`grouped`).
chunked  (transport `bucketed`): the send buffer is P chunks of C rows, one per
         destination, each in (local expert, queue) order; one dense `all_to_all` moves
         exactly P*C rows, so the wire carries C rows per pair whatever the routing: with
         C near the average (1.1-1.25x T*K/P, sized by the trainer's buffer ladder) that
         is the routed bytes plus a small rounding, at dense all-to-all speed, on any
         platform. The binding limit is what one source sends one destination.

Both return an `ExchangeLayout`: the send rows of each copy, the two exchange
directions, where each (source, local expert) segment starts in the receive buffer,
and the accounting (rows the routing needed, bytes the transport moves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.moe.exchange import (
    Plan,
    exchange,
    exclusive_cumsum,
    plan_from_segments,
    plan_from_sizes,
    wire_bytes,
)
from xmoe_jax.moe.transports import arrival, get


class ExchangeLayout(NamedTuple):
    dest_TK: jax.Array  # send-buffer row of each copy (num_send: not sent)
    num_send: int  # send-buffer rows
    sent_TK: jax.Array  # kept copies that fit
    num_recv: int  # receive-buffer rows
    cc_PL: jax.Array  # rows received from each (source, local expert)
    seg_start_PL: jax.Array  # where that segment starts in the receive buffer
    forward: Callable  # send buffer [num_send, D] -> receive buffer [num_recv, D]
    backward: Callable  # receive buffer -> send buffer (the combine path)
    wire_rows: jax.Array  # rows this device puts on the wire per direction (incl. padding)
    routed_rows: jax.Array  # rows the routing sent off this device per direction
    peak_rows: jax.Array  # rows the binding buffer had to hold (fits when <= buffer_rows)
    buffer_rows: int  # the binding buffer's rows: M (compact) or C (chunked)
    grouped: bool = False  # the received rows are grouped by local expert: seg_start_PL is expert-major
    plan: Plan | None = None  # compact: the forward exchange's plan (its reverse is the return)
    max_piece: int = 0  # compact: the most rows one update moves
    # float32 [num_send, c] -> [num_recv, c]: a few numbers per row (the routing weights) along the
    # forward's plan, differentiable; a dense all_to_all (`emulated`'s mover for compact: bytes a row
    # are too few for the row transports' kernels, and too few to matter on the wire)
    scalars: Callable | None = None


def _counts(topk_idx_TK, keep_TK, num_experts, axis_name, num_peers):
    counts_E = jnp.zeros((num_experts,), jnp.int32).at[topk_idx_TK].add(keep_TK.astype(jnp.int32))
    counts_PE = jax.lax.all_gather(counts_E, axis_name)  # [source, expert]
    return counts_E, counts_PE.reshape(num_peers, num_peers, num_experts // num_peers)  # source, dest, local


def compact(
    topk_idx_TK, keep_TK, pos_TK, num_experts, num_recv, axis_name, num_peers, transport, decomposed=False
):
    num_tokens, top_k = topk_idx_TK.shape
    local_e = num_experts // num_peers
    num_send = num_tokens * top_k
    max_chunk = num_tokens * min(top_k, local_e)
    me = jax.lax.axis_index(axis_name)
    counts_E, block_PQL = _counts(topk_idx_TK, keep_TK, num_experts, axis_name, num_peers)
    dest_TK = jnp.where(keep_TK, exclusive_cumsum(counts_E)[topk_idx_TK] + pos_TK, num_send)
    # each destination fills its M rows in (source, local expert) order; the rest overflow
    flat_QX = block_PQL.transpose(1, 0, 2).reshape(num_peers, num_peers * local_e)
    cc_QX = jnp.clip(num_recv - exclusive_cumsum(flat_QX), 0, flat_QX)
    cc_PQL = cc_QX.reshape(num_peers, num_peers, local_e).transpose(1, 0, 2)
    cc_PL = cc_PQL[:, me, :]
    grouped = arrival(transport) == "expert"
    if grouped:  # update (p, q, l): the first cc rows of p's queue for expert (q, l) -> q's group l
        src_PQL = exclusive_cumsum(block_PQL.reshape(num_peers, num_experts), axis=1).reshape(block_PQL.shape)
        dst_PQL = exclusive_cumsum(cc_PQL.sum(0), axis=1)[None] + exclusive_cumsum(cc_PQL, axis=0)
        plan, updates = plan_from_segments(cc_PQL, src_PQL, dst_PQL, me), local_e
        seg_start_PL, max_piece = dst_PQL[:, me, :], num_tokens  # a token sends an expert one copy
    else:  # one update per peer: segments in (source, local expert) order
        plan, updates = plan_from_sizes(cc_PQL.sum(-1), block_PQL.sum(-1), me), 1
        seg_start_PL, max_piece = exclusive_cumsum(cc_PL.reshape(-1)).reshape(cc_PL.shape), max_chunk
    sent_E = cc_PQL[me].reshape(num_experts)  # rows of each expert that fit at their destination
    sent_Q = cc_PQL[me].sum(-1)
    return ExchangeLayout(
        dest_TK=dest_TK,
        num_send=num_send,
        sent_TK=keep_TK & (pos_TK < sent_E[topk_idx_TK]),
        num_recv=num_recv,
        cc_PL=cc_PL,
        seg_start_PL=seg_start_PL,
        forward=lambda x: exchange(x, plan, num_recv, num_send, axis_name, transport, max_piece),
        backward=lambda y: exchange(y, plan.reverse(), num_send, num_recv, axis_name, transport, max_piece),
        wire_rows=wire_bytes(plan, me, 1, transport, max_piece, num_recv, decomposed, updates),
        routed_rows=(sent_Q.sum() - sent_Q[me]).astype(jnp.float32),
        peak_rows=block_PQL[:, me, :].sum(),
        buffer_rows=num_recv,
        grouped=grouped,
        plan=plan,
        max_piece=max_piece,
        scalars=lambda g: exchange(g, plan, num_recv, num_send, axis_name, get("emulated"), max_piece),
    )


def chunked(topk_idx_TK, keep_TK, pos_TK, num_experts, chunk_rows, axis_name, num_peers):
    num_tokens, top_k = topk_idx_TK.shape
    local_e = num_experts // num_peers
    num_send = num_recv = num_peers * chunk_rows
    me = jax.lax.axis_index(axis_name)
    counts_E, block_PQL = _counts(topk_idx_TK, keep_TK, num_experts, axis_name, num_peers)
    # rank of each copy among my copies to its destination, in (local expert, queue) order
    start_E = exclusive_cumsum(counts_E.reshape(num_peers, local_e), axis=1).reshape(num_experts)
    rank_TK = start_E[topk_idx_TK] + pos_TK
    sent_TK = keep_TK & (rank_TK < chunk_rows)
    dest_TK = jnp.where(sent_TK, (topk_idx_TK // local_e) * chunk_rows + rank_TK, num_send)
    cc_PQL = jnp.clip(chunk_rows - exclusive_cumsum(block_PQL, axis=2), 0, block_PQL)
    cc_PL = cc_PQL[:, me, :]
    peers = jnp.arange(num_peers, dtype=jnp.int32)

    def a2a(x_ND):
        x_PCD = x_ND.reshape(num_peers, chunk_rows, x_ND.shape[-1])
        return jax.lax.all_to_all(x_PCD, axis_name, 0, 0).reshape(num_peers * chunk_rows, x_ND.shape[-1])

    sent_Q = cc_PQL[me].sum(-1)
    return ExchangeLayout(
        dest_TK=dest_TK,
        num_send=num_send,
        sent_TK=sent_TK,
        num_recv=num_recv,
        cc_PL=cc_PL,
        seg_start_PL=peers[:, None] * chunk_rows + exclusive_cumsum(cc_PL, axis=1),
        forward=a2a,
        backward=a2a,
        wire_rows=jnp.asarray((num_peers - 1) * chunk_rows, jnp.float32),
        routed_rows=(sent_Q.sum() - sent_Q[me]).astype(jnp.float32),
        peak_rows=block_PQL[:, me, :].sum(-1).max(),
        buffer_rows=chunk_rows,
        scalars=a2a,
    )
