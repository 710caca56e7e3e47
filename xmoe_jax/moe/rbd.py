"""`rbd` dispatch: redundancy-bypassing two-stage exchange (X-MoE's RBD), exact.

Per device inside one `shard_map`; the expert devices form N nodes x G local
devices (mesh axes `node` x `local`), L experts per device, EN = G*L experts per
node, experts numbered node-major. Shapes: T local tokens, K top-k, D model,
A1 = T*min(K, N, M) pilot send rows, M1 = N*T pilot receive rows, K2 = min(K, EN).

Node-limited routing (`parallel.route_groups_by_node`: the router's groups are the nodes and
it keeps M = moe.topk_groups of them per token, DeepSeek-V3) bounds each token's pilots, so the
rows it sends across nodes, by M: the send buffer holds T*M rows instead of T*min(K, N), and
`max_nodes_per_token` reports the most nodes a token reached (rows that would not fit count as
overflow, never dropped silently).

Dispatch:
  1. pilots: each token sends ONE row per destination node holding any of its kept
     experts (node-major send buffer, no sort), with metadata: the token's node-local
     expert ids and combine weights on that node (K2 slots, padded);
  2. stage 1 moves pilots along the node axis to the same local rank on the
     destination node (ragged exchange; at most T pilots per source, so M1 = N*T
     rows can never overflow);
  3. stage 2 is exactly PFT inside the node (pft.py) with the received pilots as its
     tokens: replicas are built from the pilot rows by the permute kernel, exchanged
     over the local axis, run through the experts (which fold in the replicas' combine
     weights), returned, and summed into their pilot by the combine kernel;
Combine: stage 1 in reverse carries that one partial sum per (token, node) back;
the source adds its partial sums. The backward pass is the same dedup in reverse:
every exchange's VJP is its reverse exchange (exchange.py).

`rbd_stages` yields at each step's end (pilots, stage1, stage2/<pft stages>,
stage2/combine, return) and returns (y_TD, ExchangeStats) (stages.py).

The released X-MoE RBD is wrong (buffer order disagreement between dispatch and
combine, replica weights missing a permutation, several experts per device); here
every row's destination is computed once and reused by both directions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.kernels import combine, permute
from xmoe_jax.moe.capacity import expert_positions
from xmoe_jax.moe.exchange import exchange, exclusive_cumsum, move_rows, plan_from_sizes, wire_bytes
from xmoe_jax.moe.pft import ExchangeSpec, pair_rows, pft_stages, recv_rows
from xmoe_jax.moe.stages import Stages, prefixed
from xmoe_jax.moe.stats import exchange_matrix
from xmoe_jax.moe.transports import Transport
from xmoe_jax.remat import EXCHANGE_IN, EXCHANGE_OUT, MOE_DISPATCHED, tag


def stage2_spec(
    num_experts: int,
    top_k: int,
    activation: str,
    num_tokens: int,
    num_nodes: int,
    local_size: int,
    recv_buffer_factor: float | None,
    chunked: bool = False,
) -> ExchangeSpec:
    """The exchange stage 2 runs PFT with: the node's experts, pilots as tokens with K2 slots.

    Stage 2 has M1 = N*T pilot rows of K2 slots, a static worst case far above the
    copies that really arrive. `recv_buffer_factor` f keeps its meaning from pft: the
    receive buffer holds f times the average copies per device, T*K (as a device would
    receive under pft), not f times M1*K2; with `chunked` (the bucketed transport) each
    (source, destination) chunk holds f times the average T*K/G.
    """
    per_node = num_experts // num_nodes
    slots = min(top_k, per_node)
    factor = recv_buffer_factor
    if factor is not None:
        factor = factor * num_tokens * top_k / (num_nodes * num_tokens * slots)
    sizes = (per_node, slots, num_nodes * num_tokens, local_size, None, factor)
    chunk = pair_rows(*sizes) if chunked else None
    mean = num_tokens * top_k / (local_size if chunked else 1)  # factor 1 = pft's average load
    return ExchangeSpec(per_node, slots, recv_rows(*sizes), activation, chunk, mean)


def rbd_stages(
    x_TD: jax.Array,
    topk_idx_TK: jax.Array,
    gate_TK: jax.Array,
    keep_TK: jax.Array,
    experts: dict,
    num_experts: int,
    activation: str,
    *,
    node_axis: str,
    local_axis: str,
    num_nodes: int,
    local_size: int,
    transport: Transport,
    recv_buffer_factor: float | None,
    max_nodes: int | None = None,
    decomposed: bool = False,
) -> Stages:
    """The dispatch as stages (stages.py): pilots, stage1, stage2/<pft stages>, return, combine.

    Returns (y_TD, ExchangeStats) at the end. Stage 2 runs pft with `transport`; stage 1 with the
    record's `node_stage()` (a chunked transport such as `bucketed` has no ragged exchange: its
    stage 1 is the emulated one, chunks of T pilots per node pair, the most a node can send
    another). `max_nodes`: node-limited routing's M (module docstring).
    `decomposed`: `parallel.ragged_decomposed` (what `ragged` puts on the wire, exchange.py).
    """
    stage1_transport = transport.node_stage()
    num_tokens, top_k = topk_idx_TK.shape
    per_node = num_experts // num_nodes
    slots = min(top_k, per_node)
    num_send = num_tokens * min(top_k, num_nodes, max_nodes or num_nodes)
    num_recv = num_nodes * num_tokens

    # 1. pilots: one per (token, node) with a kept expert there; node-major rows
    node_TK = topk_idx_TK // per_node
    match_TNK = (node_TK[:, None, :] == jnp.arange(num_nodes)[None, :, None]) & keep_TK[:, None, :]
    hit_TN = match_TNK.any(-1)
    counts_N = hit_TN.sum(0).astype(jnp.int32)
    rank_TN = jnp.cumsum(hit_TN, axis=0) - hit_TN
    dest_TN = jnp.where(hit_TN, exclusive_cumsum(counts_N)[None, :] + rank_TN, num_send).astype(jnp.int32)
    # metadata: the token's experts on each node, valid slots first
    order_TNK = jnp.argsort(~match_TNK, axis=-1, stable=True)[..., :slots]
    valid_TNS = jnp.take_along_axis(match_TNK, order_TNK, axis=-1)
    local_idx_TNS = jnp.where(
        valid_TNS,
        jnp.take_along_axis(
            jnp.broadcast_to(topk_idx_TK[:, None, :] % per_node, match_TNK.shape), order_TNK, axis=-1
        ),
        per_node,
    )
    weight_TNS = jnp.where(
        valid_TNS,
        jnp.take_along_axis(jnp.broadcast_to(gate_TK[:, None, :], match_TNK.shape), order_TNK, axis=-1),
        0.0,
    )
    flat_dest = dest_TN.reshape(-1)
    idx_send_AS = (
        jnp.full((num_send, slots), per_node, jnp.int32)
        .at[flat_dest]
        .set(local_idx_TNS.reshape(-1, slots).astype(jnp.int32), mode="drop")
    )
    w_send_AS = (
        jnp.zeros((num_send, slots), jnp.float32)
        .at[flat_dest]
        .set(weight_TNS.reshape(-1, slots).astype(jnp.float32), mode="drop")
    )
    x_send_AD = permute(x_TD, dest_TN, num_send)
    yield "pilots", (x_send_AD, idx_send_AS, w_send_AS)

    # 2. stage 1 along the node axis
    sizes_PQ = jax.lax.all_gather(counts_N, node_axis)  # [source node, dest node] pilots
    plan = plan_from_sizes(sizes_PQ, sizes_PQ, jax.lax.axis_index(node_axis))
    x_pil_MD = tag(
        tag(
            exchange(x_send_AD, plan, num_recv, num_send, node_axis, stage1_transport, num_tokens),
            EXCHANGE_IN,
        ),
        MOE_DISPATCHED,
    )
    w_pil_MS = tag(
        exchange(w_send_AS, plan, num_recv, num_send, node_axis, stage1_transport, num_tokens), EXCHANGE_IN
    )
    idx_pil_MS = tag(
        move_rows(idx_send_AS, plan, num_recv, node_axis, stage1_transport, num_tokens), EXCHANGE_IN
    )
    valid_M = jnp.arange(num_recv) < plan.recv_sizes_P.sum()
    keep_MS = valid_M[:, None] & (idx_pil_MS < per_node)
    yield "stage1", (x_pil_MD, w_pil_MS, idx_pil_MS)

    # 3. stage 2: PFT inside the node, pilots as tokens; returns each pilot's in-node weighted sum
    node_spec = stage2_spec(
        num_experts,
        top_k,
        activation,
        num_tokens,
        num_nodes,
        local_size,
        recv_buffer_factor,
        transport.layout == "chunked",
    )
    gate_MS = jnp.where(keep_MS, w_pil_MS, 0.0)
    pos_MS = expert_positions(jnp.where(keep_MS, idx_pil_MS, per_node), gate_MS, per_node + 1, "position")
    y_pil_MD, stats2 = yield from prefixed(
        "stage2",
        pft_stages(
            x_pil_MD,
            jnp.where(keep_MS, idx_pil_MS, 0),
            gate_MS,
            keep_MS,
            pos_MS,
            experts,
            node_spec,
            axis_name=local_axis,
            num_peers=local_size,
            transport=transport,
            decomposed=decomposed,
        ),
    )
    yield "stage2/combine", (y_pil_MD,)

    # combine: one partial sum per (token, node) back along the node axis, then summed per token
    y_back_AD = tag(
        exchange(y_pil_MD, plan.reverse(), num_send, num_recv, node_axis, stage1_transport, num_tokens),
        EXCHANGE_OUT,
    )
    yield "return", (y_back_AD,)
    # a plain sum (dest_TN drops the nodes a token did not reach), which keeps no rows for its backward
    y_TD = combine(y_back_AD, dest_TN)

    me = jax.lax.axis_index(node_axis)
    row_bytes = x_TD.shape[1] * jnp.dtype(x_TD.dtype).itemsize
    inter = counts_N.sum() - counts_N[me]
    node_wire = wire_bytes(plan, me, row_bytes, stage1_transport, num_tokens, num_recv, decomposed)
    stats = stats2._replace(
        num_overflow=stats2.num_overflow + jnp.maximum(counts_N.sum() - num_send, 0),
        max_nodes_per_token=hit_TN.sum(-1).max().astype(jnp.int32),
        pilot_rows=counts_N.sum(),
        inter_node_rows=inter,
        wire_bytes_node=2 * node_wire,
        routed_bytes_node=2 * row_bytes * inter.astype(jnp.float32),
        exchange_rows=exchange_matrix(  # over the whole expert axis, node-major
            topk_idx_TK, keep_TK, num_experts, num_nodes * local_size,
            jax.lax.axis_index((node_axis, local_axis)),
        ),
    )  # fmt: skip
    return y_TD.astype(x_TD.dtype), stats
