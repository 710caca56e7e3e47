"""`pft` dispatch: padding-free token buffers with a ragged exchange (X-MoE's PFT).

Per device, inside one `shard_map` over the token axes; P peers on the expert axis,
each holding L = E/P experts. Shapes: T local tokens, K top-k, A = T*K send rows,
D model, E experts, L local experts, M receive rows.

Steps:
  1. the kept copies (after capacity) are placed expert-major into a flat [A, D]
     send buffer; row = start of its expert + its position in the expert's queue
     (no sort beyond the one `capacity.expert_positions` already did), by the
     permute kernel (xmoe_jax/kernels; XLA's reference on CPU);
  2. every device learns every device's per-expert counts (one small all-gather),
     so send sizes, receive sizes and all offsets are computed on device, identical
     everywhere, with no host synchronisation;
  3. the receive buffer has a static M rows (worst case by default). If a peer
     would overflow it, the rows past M (in source-then-expert order) are not sent,
     counted as `num_overflow`, and contribute zero: never silently;
  4. one ragged exchange moves exactly the routed rows (exchange.py);
  5. received rows stay where they arrived. Where the transport lands them grouped by local
     expert (`arrival: expert`, the push kernel: layouts.compact), the local experts' grouped
     GEMMs read and write them in place, with no index at all. Landed in (source, local
     expert) order, the GEMMs read them through a grouped -> arrival row index
     (`_arrival_index`; gather on load, no expert-major copy);
  6. the routing weights travel with the rows (one float32 each, a small dense exchange:
     layouts' `scalars`) and are folded into the expert activation before the down-projection
     (Megatron's way), which stores each weighted output at its arrival row (in place, or
     scatter on store: no ungrouping copy); the outputs go back by the reverse exchange and the
     combine kernel sums each token's rows (float32 accumulation). That sum has no weights to
     differentiate, so the backward pass keeps none of the returned [A, D] rows: the weights'
     gradient <dy W_down^T, act> comes from the expert side's backward. A transport with a `gmm_move`
     (push) runs that reverse exchange inside the down-projection's kernel, and the backward's
     inside the up-projections' data-gradient GEMM: each row goes straight back to its source
     (experts.pushed_experts). There the "exchange" stage ends with the experts' output and the
     "experts" and "return" stages are empty. Receive-buffer rows that
     hold no row stay unwritten in both passes' outputs; nothing reads them.
With one peer there is no exchange: steps 5-6 are the experts and the combine in one piece
(`experts.combined_experts`), whose backward pass keeps no [A, D] buffer.

`pft_stages` yields at each step's end (send_buffer, exchange, experts, return) and
returns (y_TD, ExchangeStats): the layer runs it whole, the stage benchmark one prefix
at a time (stages.py). It knows the layer only through an `ExchangeSpec` (experts,
slots, receive rows, activation), so RBD's stage 2 runs it on the node's experts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.fp8.dispatch import fp8_exchange
from xmoe_jax.kernels import combine, permute
from xmoe_jax.moe import layouts
from xmoe_jax.moe.exchange import exclusive_cumsum
from xmoe_jax.moe.experts import Return, arrival_experts, combined_experts, pushed_experts
from xmoe_jax.moe.stages import Stages
from xmoe_jax.moe.stats import ExchangeStats, exchange_matrix
from xmoe_jax.moe.transports import Transport, arrive_gmm, gmm_move
from xmoe_jax.remat import EXCHANGE_IN, EXCHANGE_OUT, EXPERT_HIDDEN, MOE_DISPATCHED, keeps, tag

ROW_ALIGN = 8  # the compact receive buffer's rows are a multiple of this (Mosaic tiles GMEM rows by 8)


class ExchangeSpec(NamedTuple):
    """The exchange one pft dispatch runs: all it needs to know of the layer (static)."""

    num_experts: int  # experts over the exchange group, E = P * L
    slots: int  # routed copies per token, K
    recv_rows: int  # static receive-buffer rows M per device (compact layout)
    activation: str  # expert MLP activation
    chunk_rows: int | None = None  # rows per (source, destination) chunk: the chunked layout
    mean_rows: float | None = None  # the binding buffer's rows at factor 1: T*K (compact), T*K/P (chunked)


def _buffer_rows(
    num_experts: int,
    top_k: int,
    num_tokens: int,
    num_peers: int,
    capacity: int | None,
    factor: float | None,
    per_pair: bool,
) -> int:
    """Rows of a receive buffer that holds what `sources` devices send one device (all P peers
    for the compact layout, one per chunk of the chunked layout): at most T*min(K, L) per source
    (L*C with a per-expert capacity C), capped at f x the average, T*K*sources/P. The compact
    buffer is rounded up to a multiple of ROW_ALIGN rows: the expert GEMMs run on it in place, and
    our Mosaic kernels take only such row counts (gmm/mgpu_ws.py; a factor's row count fell back
    to Pallas)."""
    local_experts = num_experts // num_peers
    sources = 1 if per_pair else num_peers
    worst = sources * num_tokens * min(top_k, local_experts)
    if capacity is not None:
        worst = min(worst, sources * local_experts * capacity)
    if factor is not None:
        worst = min(worst, math.ceil(factor * num_tokens * top_k / (num_peers if per_pair else 1)))
    return max(worst, 1) if per_pair else -(-max(worst, 1) // ROW_ALIGN) * ROW_ALIGN


def recv_rows(
    num_experts: int,
    top_k: int,
    num_tokens: int,
    num_peers: int,
    capacity: int | None = None,
    factor: float | None = None,
) -> int:
    """Static receive-buffer rows M for T local tokens and P peers (compact layout).

    Worst case: every peer sends every token to min(K, L) of my experts. With a
    per-expert `capacity` C, a peer sends at most L*C rows. `factor` f caps M at
    ceil(f * T * K) (f = 1 is the average load under perfect balance).
    """
    return _buffer_rows(num_experts, top_k, num_tokens, num_peers, capacity, factor, per_pair=False)


def pair_rows(
    num_experts: int,
    top_k: int,
    num_tokens: int,
    num_peers: int,
    capacity: int | None = None,
    factor: float | None = None,
) -> int:
    """Rows per (source, destination) chunk of the chunked layout: f x the average T*K/P,
    at most the worst case one source can send one destination, T*min(K, L) (L*C with capacity)."""
    return _buffer_rows(num_experts, top_k, num_tokens, num_peers, capacity, factor, per_pair=True)


def _arrival_index(cc_PL: jax.Array, seg_start_PL: jax.Array, num_rows: int) -> jax.Array:
    """int32 [M]: the receive-buffer row of each grouped row, the experts' gather / scatter index
    (num_rows for grouped rows past the received total).

    Received rows come as segments (source p, local expert l) of cc_PL[p, l] rows starting at
    seg_start_PL[p, l]; grouped by expert, expert l's rows from all sources are contiguous, in
    source order: segment (p, l) starts at grouped row seg_dest[p, l].
    """
    seg_dest_PL = exclusive_cumsum(cc_PL.sum(0))[None, :] + exclusive_cumsum(cc_PL, axis=0)
    # segments in grouped order, (l, p): their grouped starts increase
    dest_X, start_X = seg_dest_PL.T.reshape(-1), seg_start_PL.T.reshape(-1)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # a grouped row belongs to the last segment starting at or before it (empty ones share a start)
    seg = jnp.clip(jnp.searchsorted(dest_X, rows, side="right") - 1, 0, dest_X.shape[0] - 1)
    return jnp.where(rows < cc_PL.sum(), start_X[seg] + rows - dest_X[seg], num_rows).astype(jnp.int32)


def pft_stages(
    x_TD: jax.Array,
    topk_idx_TK: jax.Array,
    gate_TK: jax.Array,
    keep_TK: jax.Array,
    pos_TK: jax.Array,
    experts: dict,
    spec: ExchangeSpec,
    *,
    axis_name: str | None,
    num_peers: int,
    transport: Transport,
    decomposed: bool = False,
) -> Stages:
    """The dispatch as stages (stages.py): send_buffer, [exchange, experts, return], combine.

    Returns (y_TD, ExchangeStats) at the end; with one peer there is no exchange stage.
    `decomposed`: `parallel.ragged_decomposed` (what `ragged` puts on the wire, exchange.py).
    """
    num_tokens, top_k = topk_idx_TK.shape
    num_e, dim = spec.num_experts, x_TD.shape[1]
    row_bytes = dim * jnp.dtype(x_TD.dtype).itemsize

    if num_peers == 1:  # no exchange: the expert-major send buffer is already grouped by expert
        num_send = num_tokens * top_k
        counts_E = jnp.zeros((num_e,), jnp.int32).at[topk_idx_TK].add(keep_TK.astype(jnp.int32))
        dest_TK = jnp.where(keep_TK, exclusive_cumsum(counts_E)[topk_idx_TK] + pos_TK, num_send)
        # the send buffer is the experts' input; the experts permute it themselves (so their
        # backward pass keeps x_TD, not this K-times larger buffer): this copy is for stage timing
        x_send_AD = tag(permute(x_TD, dest_TK, num_send), MOE_DISPATCHED)
        yield "send_buffer", (x_send_AD,)
        # the rows never leave the device: experts and combine in one piece (experts.py), whose
        # backward pass keeps neither the [A, D] rows nor the experts' outputs
        weights_TK = jnp.where(keep_TK, gate_TK, 0.0).astype(jnp.float32)
        y_TD = combined_experts(x_TD, dest_TK, num_send, experts, counts_E, spec.activation, weights_TK)
        yield "experts", (y_TD,)
        zero = jnp.zeros((), jnp.float32)
        stats = ExchangeStats(
            num_overflow=jnp.zeros((), jnp.int32), recv_rows=counts_E.sum(), wire_bytes=zero,
            routed_bytes=zero, peak_rows=counts_E.sum(), buffer_rows=jnp.asarray(num_send, jnp.int32),
            peak_ratio=zero, exchange_rows=counts_E.sum().reshape(1, 1),
        )  # fmt: skip
        return y_TD.astype(x_TD.dtype), stats
    else:
        if spec.chunk_rows is not None:
            lay = layouts.chunked(topk_idx_TK, keep_TK, pos_TK, num_e, spec.chunk_rows, axis_name, num_peers)
        else:
            sizes = (num_e, spec.recv_rows, axis_name, num_peers, transport, decomposed)
            lay = layouts.compact(topk_idx_TK, keep_TK, pos_TK, *sizes)
        sent_TK = lay.sent_TK
        # copies that overflow are neither written to the send buffer nor read back from it: a transport
        # may leave rows it did not move undefined (push), and permute's VJP reads each copy's row at weight 1
        dest_TK = jnp.where(sent_TK, lay.dest_TK, lay.num_send)
        x_send_AD = tag(permute(x_TD, dest_TK, lay.num_send), MOE_DISPATCHED)
        # the routing weights travel with their rows and are folded in on the expert side, so the rows
        # come back weighted and the combine is a plain sum that keeps none of them for the backward
        weights_A1 = jnp.where(sent_TK, gate_TK, 0.0).astype(jnp.float32).reshape(-1, 1)
        rows_A = dest_TK.reshape(-1)
        g_send_A1 = jnp.zeros((lay.num_send, 1), jnp.float32).at[rows_A].add(weights_A1, mode="drop")
        g_recv_M = tag(lay.scalars(g_send_A1)[:, 0], EXCHANGE_IN)
        yield "send_buffer", (x_send_AD,)
        recipe = fp8_context.recipe_for("dispatch")  # FP8 on the wire, dequantized on arrival
        send_row_bytes = row_bytes if recipe is None else dim + 4 * -(-dim // 128)  # e4m3 + f32 scales
        fused = lay.grouped and gmm_move(transport) and recipe is None
        if fused and fp8_context.recipe_for("experts") is None:
            # the exchanges back to the sources run inside the GEMMs before them (push: under them);
            # the exchange stage ends after the up-projections, which the received rows go straight into
            arrive, keep_hidden = arrive_gmm(transport), keeps(EXPERT_HIDDEN)
            ret = Return(lay.num_send, lay.num_recv, axis_name, transport, lay.max_piece, arrive, keep_hidden)
            y_send_AD = pushed_experts(
                x_send_AD, experts, lay.cc_PL.sum(0), spec.activation, lay.plan, ret, g_recv_M
            )
            y_send_AD = tag(y_send_AD, EXCHANGE_OUT)
            yield "exchange", (y_send_AD,)
            yield "experts", (y_send_AD,)
        else:
            x_recv_MD = (
                lay.forward(x_send_AD) if recipe is None else fp8_exchange(lay.forward, x_send_AD, recipe)
            )
            x_recv_MD = tag(x_recv_MD, EXCHANGE_IN)
            yield "exchange", (x_recv_MD, g_recv_M)
            # the experts read the received rows in place and write their outputs back in place
            arrival_M = None if lay.grouped else _arrival_index(lay.cc_PL, lay.seg_start_PL, lay.num_recv)
            y_recv_MD = arrival_experts(
                x_recv_MD, arrival_M, experts, lay.cc_PL.sum(0), spec.activation, g_recv_M
            )
            yield "experts", (y_recv_MD,)
            y_send_AD = tag(lay.backward(y_recv_MD), EXCHANGE_OUT)
        yield "return", (y_send_AD,)
        stats = ExchangeStats(  # dispatch + combine: both directions carry the same rows
            num_overflow=jnp.sum(keep_TK & ~sent_TK).astype(jnp.int32),
            recv_rows=lay.cc_PL.sum(),
            wire_bytes=(send_row_bytes + row_bytes) * lay.wire_rows,
            routed_bytes=(send_row_bytes + row_bytes) * lay.routed_rows,
            peak_rows=lay.peak_rows,
            buffer_rows=jnp.asarray(lay.buffer_rows, jnp.int32),
            peak_ratio=lay.peak_rows.astype(jnp.float32) / (spec.mean_rows or 1.0),
            exchange_rows=exchange_matrix(
                topk_idx_TK, keep_TK, num_e, num_peers, jax.lax.axis_index(axis_name)
            ),
        )

    y_TD = combine(y_send_AD, dest_TK)  # weighted already (dest_TK drops the copies not sent)
    return y_TD.astype(x_TD.dtype), stats
