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
  5. received rows, ordered (source, local expert), are permuted into expert-major
     groups (permute kernel) and the local experts run as grouped GEMMs;
  6. outputs are put back in arrival order, go back by the reverse exchange and are
     combined with the routing weights (combine kernel, float32 accumulation).

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

from xmoe_jax.kernels import combine, permute
from xmoe_jax.moe.exchange import exchange, exclusive_cumsum, plan_from_sizes, wire_bytes
from xmoe_jax.moe.experts import grouped_experts
from xmoe_jax.moe.stages import Stages
from xmoe_jax.moe.stats import ExchangeStats
from xmoe_jax.remat import MOE_DISPATCHED, tag


class ExchangeSpec(NamedTuple):
    """The exchange one pft dispatch runs: all it needs to know of the layer (static)."""

    num_experts: int  # experts over the exchange group, E = P * L
    slots: int  # routed copies per token, K
    recv_rows: int  # static receive-buffer rows M per device
    activation: str  # expert MLP activation


def recv_rows(
    num_experts: int,
    top_k: int,
    num_tokens: int,
    num_peers: int,
    capacity: int | None = None,
    factor: float | None = None,
) -> int:
    """Static receive-buffer rows M for T local tokens and P peers.

    Worst case: every peer sends every token to min(K, L) of my experts. With a
    per-expert `capacity` C, a peer sends at most L*C rows. `factor` f caps M at
    ceil(f * T * K) (f = 1 is the average load under perfect balance).
    """
    local_experts = num_experts // num_peers
    worst = num_peers * num_tokens * min(top_k, local_experts)
    if capacity is not None:
        worst = min(worst, num_peers * local_experts * capacity)
    if factor is not None:
        worst = min(worst, math.ceil(factor * num_tokens * top_k))
    return max(worst, 1)


def _grouped_index(cc_PL: jax.Array, num_rows: int) -> jax.Array:
    """Row of each received row (ordered source-major) in the expert-major grouped buffer."""
    seg_len = cc_PL.reshape(-1)
    seg_end = jnp.cumsum(seg_len)
    seg_start = seg_end - seg_len
    seg_dest = (exclusive_cumsum(cc_PL.sum(0))[None, :] + exclusive_cumsum(cc_PL, axis=0)).reshape(-1)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(seg_end, rows, side="right"), seg_len.shape[0] - 1)
    return jnp.where(rows < seg_end[-1], seg_dest[seg] + rows - seg_start[seg], num_rows)


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
    transport: str,
) -> Stages:
    """The dispatch as stages (stages.py): send_buffer, [exchange, experts, return], combine.

    Returns (y_TD, ExchangeStats) at the end; with one peer there is no exchange stage.
    """
    num_tokens, top_k = topk_idx_TK.shape
    num_e, dim = spec.num_experts, x_TD.shape[1]
    local_e = num_e // num_peers
    num_send = num_tokens * top_k

    counts_E = jnp.zeros((num_e,), jnp.int32).at[topk_idx_TK].add(keep_TK.astype(jnp.int32))
    dest_TK = jnp.where(keep_TK, exclusive_cumsum(counts_E)[topk_idx_TK] + pos_TK, num_send)
    x_send_AD = tag(permute(x_TD, dest_TK, num_send), MOE_DISPATCHED)
    yield "send_buffer", (x_send_AD,)

    if num_peers == 1:  # no exchange: the send buffer is already grouped by expert
        y_send_AD = grouped_experts(x_send_AD, experts, counts_E, spec.activation)
        yield "experts", (y_send_AD,)
        sent_TK = keep_TK
        recv, wire = counts_E.sum(), jnp.zeros((), jnp.float32)
    else:
        me = jax.lax.axis_index(axis_name)
        num_recv = spec.recv_rows
        max_chunk = num_tokens * min(top_k, local_e)
        counts_PE = jax.lax.all_gather(counts_E, axis_name)  # [source, expert]
        block_PQL = counts_PE.reshape(num_peers, num_peers, local_e)  # source, dest, local expert
        # each destination fills its M rows in (source, local expert) order; the rest overflow
        flat_QX = block_PQL.transpose(1, 0, 2).reshape(num_peers, num_peers * local_e)
        cc_QX = jnp.clip(num_recv - exclusive_cumsum(flat_QX), 0, flat_QX)
        cc_PQL = cc_QX.reshape(num_peers, num_peers, local_e).transpose(1, 0, 2)
        plan = plan_from_sizes(cc_PQL.sum(-1), block_PQL.sum(-1), me)
        x_recv_MD = exchange(x_send_AD, plan, num_recv, num_send, axis_name, transport, max_chunk)
        yield "exchange", (x_recv_MD,)
        cc_PL = cc_PQL[:, me, :]
        grouped_M = _grouped_index(cc_PL, num_recv)
        x_grp_MD = tag(permute(x_recv_MD, grouped_M[:, None], num_recv), MOE_DISPATCHED)
        y_grp_MD = grouped_experts(x_grp_MD, experts, cc_PL.sum(0), spec.activation)
        yield "experts", (y_grp_MD,)
        y_recv_MD = combine(y_grp_MD, grouped_M[:, None], jnp.ones((num_recv, 1), jnp.float32))
        y_send_AD = exchange(y_recv_MD, plan.reverse(), num_send, num_recv, axis_name, transport, max_chunk)
        yield "return", (y_send_AD,)
        sent_E = cc_PQL[me].reshape(num_e)  # rows of each expert that fit at their destination
        sent_TK = keep_TK & (pos_TK < sent_E[topk_idx_TK])
        row_bytes = dim * jnp.dtype(x_TD.dtype).itemsize
        recv = cc_PL.sum()
        # dispatch + combine, both directions carry the same rows
        wire = 2 * wire_bytes(plan, me, row_bytes, transport, max_chunk)

    y_TD = combine(y_send_AD, dest_TK, jnp.where(sent_TK, gate_TK, 0.0).astype(jnp.float32))
    overflow = jnp.sum(keep_TK & ~sent_TK).astype(jnp.int32)
    return y_TD.astype(x_TD.dtype), ExchangeStats(num_overflow=overflow, recv_rows=recv, wire_bytes=wire)
