"""Padding-free row exchange between the devices of one mesh axis.

Shapes: P devices on the axis (peers), D model, rows of a ragged buffer.

A `Plan` describes one ragged all-to-all from the caller's point of view, in the
argument convention of `jax.lax.ragged_all_to_all`:
  input_offsets_P[j]   where the rows for peer j start in my send buffer;
  send_sizes_P[j]      how many rows I send to peer j;
  output_offsets_P[j]  where my rows land in peer j's receive buffer;
  recv_sizes_P[j]      how many rows I receive from peer j;
  recv_offsets_P[j]    where peer j's rows land in my receive buffer;
  peer_offsets_P[j]    where the rows I receive from peer j sit in j's send buffer.
`reverse()` swaps the roles, so the combine path (and every backward pass) sends
rows back exactly where they came from. A plan may hold U updates per peer (X = P * U entries,
peer-major: entry x concerns peer x // U; the `_P` fields are then [X]): expert-major arrival
(layouts.compact) sends one update per (peer, local expert), so a receiver's rows land grouped
by expert. `plan_from_segments` builds either; the `exact` and `ragged` movers assume U = 1.

Transports (moe/transports.py holds their records: platforms, process layouts, flags, wire), one
function (`exchange`, given a record), differentiable through a custom VJP whose backward pass is
the reverse exchange. The row movers of the compact ones live here:
  exact     (`move_exact`) `jax.lax.ragged_all_to_all` with each peer's chunk split into
            `UPDATES_PER_PEER` updates: exactly the routed rows on the wire. XLA's one-shot
            kernel (one process, up to 8 peers of one host) runs one 128-thread block per
            update, so one update per peer starves it (0.08-2.7 GB/s measured); split, it
            moves the routed rows at dense all-to-all speed (benchmarks/exchange.md). Needs
            the `default` ragged preset (launch/xla_flags.py: no decomposer). On CPU, where XLA
            has no ragged all-to-all, the same split plan runs through an exact emulation;
  ragged    (`move_ragged`) `jax.lax.ragged_all_to_all` with one update per peer, as XLA lowers
            it under the process's preset (GPU; not implemented on XLA:CPU);
  emulated  (`move_emulated`) a dense `all_to_all` of per-peer chunks padded to a static bound,
            then scattered to the same offsets: moves the same rows to the same places, with
            padding on the wire. Works everywhere; the CPU tests use it;
  push      (`move_push`) our Pallas Mosaic-GPU kernel (kernels/push): each GPU writes its rows
            straight into its peers' receive buffers over NVLink and signals them; exactly the
            routed rows on the wire, no NCCL, few SMs. Receive rows no peer wrote are undefined
            (nothing reads them). On CPU the kernel's XLA reference runs the same plan.
The return of expert-major arrival can run inside the down-projection's kernel (`gmm_move`, a
transport's `gmm_move`): push's (`move_push_gmm`) is the grouped GEMM whose epilogue stores every
output row on the peer it came from, so the exchange runs under the GEMM (kernels/push: gmm_push).
The exchange before a GEMM can run inside it too (`arrive_gmm`): push's (`move_push_arrive`) pushes
the rows and multiplies each local expert's rows as soon as they have landed (kernels/push: push_gmm;
XMOE_FUSED_ARRIVE=on, not yet measured on a GPU).
The fifth transport, `bucketed`, is not a ragged exchange: pft lays its buffers out as
fixed per-peer chunks sized by the step's buffer bucket and moves them with one dense
`all_to_all` (layouts.py).

What goes on the wire: `exact`, and `ragged` under XLA's default kernel, send the routed rows; under
the `decomposer` preset (launch/xla_flags.py) XLA rewrites it into a dense all-to-all of the
whole receive buffer per peer, so (P-1) x M rows leave each device whatever the routing;
`emulated` sends (P-1) padded chunks. `wire_bytes` reports that, not the routed rows.
Whether the decomposer is in effect is a placement fact settled before tracing
(`parallel.ragged_decomposed`, set by xmoe_jax/resolve.py): nothing here reads XLA flags.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.kernels.vma import match_vma

if TYPE_CHECKING:
    from xmoe_jax.moe.transports import Transport

# updates per peer of the `exact` transport: XLA's one-shot kernel gives each update one
# 128-thread block; with 512 per peer the 4x H200 probe moved exact bytes at the dense
# all-to-all's speed (k=1: 25.8 ms, k=128: 1.40-1.53 ms, k>=512: 1.32-1.36 ms for 16,384 rows
# x 2048 bf16 per pair; issue 29)
UPDATES_PER_PEER = 512


class Plan(NamedTuple):
    input_offsets_P: jax.Array
    send_sizes_P: jax.Array
    output_offsets_P: jax.Array
    recv_sizes_P: jax.Array
    recv_offsets_P: jax.Array
    peer_offsets_P: jax.Array

    def reverse(self) -> Plan:
        return Plan(
            input_offsets_P=self.recv_offsets_P,
            send_sizes_P=self.recv_sizes_P,
            output_offsets_P=self.peer_offsets_P,
            recv_sizes_P=self.send_sizes_P,
            recv_offsets_P=self.input_offsets_P,
            peer_offsets_P=self.output_offsets_P,
        )


def exclusive_cumsum(x, axis=-1):
    """Start offsets of consecutive chunks whose sizes are `x` along `axis`."""
    return jnp.cumsum(x, axis=axis) - x


def plan_from_sizes(sizes_PQ: jax.Array, chunk_rows_PQ: jax.Array, me: jax.Array) -> Plan:
    """Device `me`'s plan when every device knows the whole [source, dest] matrices.

    `sizes_PQ[p, q]`: rows p sends q; `chunk_rows_PQ[p, q]`: rows p's send buffer reserves
    for q (>= sizes: a chunk may be sent only in part). Receivers stack sources in order.
    """
    chunk_starts_PQ = exclusive_cumsum(chunk_rows_PQ, axis=1)  # dest q's chunk in source p's buffer
    offsets_PQ = exclusive_cumsum(sizes_PQ, axis=0)  # where source p lands at dest q
    return plan_from_segments(sizes_PQ[..., None], chunk_starts_PQ[..., None], offsets_PQ[..., None], me)


def plan_from_segments(
    sizes_PQU: jax.Array, src_starts_PQU: jax.Array, dst_starts_PQU: jax.Array, me: jax.Array
) -> Plan:
    """Device `me`'s plan of U updates per peer, when every device knows every update: update
    (p, q, u) moves sizes_PQU[p, q, u] rows from row src_starts_PQU[p, q, u] of source p's send
    buffer to row dst_starts_PQU[p, q, u] of dest q's receive buffer. The plan's fields are [P * U],
    peer-major (module docstring)."""

    def mine(a_PQU):  # my updates, as sender: [Q * U]
        return a_PQU[me].reshape(-1)

    def theirs(a_PQU):  # the updates coming to me, as receiver: [P * U]
        return a_PQU[:, me].reshape(-1)

    return Plan(
        input_offsets_P=mine(src_starts_PQU),
        send_sizes_P=mine(sizes_PQU),
        output_offsets_P=mine(dst_starts_PQU),
        recv_sizes_P=theirs(sizes_PQU),
        recv_offsets_P=theirs(dst_starts_PQU),
        peer_offsets_P=theirs(src_starts_PQU),
    )


def per_peer(a_X: jax.Array, num_peers: int) -> jax.Array:
    """[P]: a plan field summed over each peer's updates (the field itself when U = 1)."""
    return a_X.reshape(num_peers, -1).sum(-1)


def move_ragged(x_ND, plan: Plan, out_rows: int, axis_name: str, max_chunk: int) -> jax.Array:
    del max_chunk
    out_MD = jnp.zeros((out_rows, x_ND.shape[1]), x_ND.dtype)
    return jax.lax.ragged_all_to_all(
        x_ND,
        out_MD,
        plan.input_offsets_P,
        plan.send_sizes_P,
        plan.output_offsets_P,
        plan.recv_sizes_P,
        axis_name=axis_name,
    )


def move_emulated(x_ND, plan: Plan, out_rows: int, axis_name: str, max_chunk: int) -> jax.Array:
    """Every update padded to `max_chunk` rows, one dense all_to_all (X = P * U updates, U per peer)."""
    rows_C = jnp.arange(max_chunk, dtype=jnp.int32)
    src_XC = plan.input_offsets_P[:, None] + rows_C[None, :]
    src_XC = jnp.where(rows_C[None, :] < plan.send_sizes_P[:, None], src_XC, x_ND.shape[0])
    chunks_XCD = x_ND.at[src_XC].get(mode="fill", fill_value=0)
    recv_XCD = jax.lax.all_to_all(chunks_XCD, axis_name, 0, 0, tiled=True)  # per source, its U for me
    dst_XC = plan.recv_offsets_P[:, None] + rows_C[None, :]
    dst_XC = jnp.where(rows_C[None, :] < plan.recv_sizes_P[:, None], dst_XC, out_rows)
    out_MD = jnp.zeros((out_rows, x_ND.shape[1]), x_ND.dtype)
    return out_MD.at[dst_XC.reshape(-1)].set(recv_XCD.reshape(-1, x_ND.shape[1]), mode="drop")


def split_updates(sizes_P: jax.Array, offsets_P: jax.Array, updates: int) -> tuple[jax.Array, jax.Array]:
    """Each chunk (offset, size) as `updates` consecutive near-equal pieces, peer-major
    ([P * updates] sizes and offsets): the first size % updates pieces get one row more. A
    receiver splits what a source sends it the same way, so both sides agree piece by piece."""
    j_U = jnp.arange(updates, dtype=sizes_P.dtype)
    base_P, rem_P = sizes_P // updates, sizes_P % updates
    piece_PU = base_P[:, None] + (j_U[None, :] < rem_P[:, None]).astype(sizes_P.dtype)
    start_PU = j_U[None, :] * base_P[:, None] + jnp.minimum(j_U[None, :], rem_P[:, None])
    return piece_PU.reshape(-1), (offsets_P[:, None] + start_PU).reshape(-1)


def _emulated_ragged(x_ND, out_MD, in_off_X, send_X, out_off_X, recv_X, axis_name, max_piece):
    """`jax.lax.ragged_all_to_all`'s semantics (X = P * k updates, update i to peer i // k) as a
    dense `all_to_all` of every update padded to `max_piece` rows: for XLA:CPU, which has none."""
    num_x = in_off_X.shape[0]
    rows_C = jnp.arange(max_piece, dtype=jnp.int32)
    src_XC = jnp.where(rows_C[None, :] < send_X[:, None], in_off_X[:, None] + rows_C[None, :], x_ND.shape[0])
    pieces_XCD = x_ND.at[src_XC].get(mode="fill", fill_value=0)
    pieces_XCD = jax.lax.all_to_all(pieces_XCD, axis_name, 0, 0, tiled=True)  # now from peer i // k
    out_off_X = jax.lax.all_to_all(out_off_X, axis_name, 0, 0, tiled=True)  # where they land here
    dst_XC = jnp.where(
        rows_C[None, :] < recv_X[:, None], out_off_X[:, None] + rows_C[None, :], out_MD.shape[0]
    )
    return out_MD.at[dst_XC.reshape(-1)].set(pieces_XCD.reshape(num_x * max_piece, -1), mode="drop")


def move_exact(x_ND, plan: Plan, out_rows: int, axis_name: str, max_chunk: int) -> jax.Array:
    updates = min(UPDATES_PER_PEER, max(max_chunk, 1))
    send_X, in_off_X = split_updates(plan.send_sizes_P, plan.input_offsets_P, updates)
    _, out_off_X = split_updates(plan.send_sizes_P, plan.output_offsets_P, updates)
    recv_X, _ = split_updates(plan.recv_sizes_P, plan.recv_offsets_P, updates)
    out_MD = jnp.zeros((out_rows, x_ND.shape[1]), x_ND.dtype)
    args = (x_ND, out_MD, in_off_X, send_X, out_off_X, recv_X)
    max_piece = -(-max_chunk // updates)
    # both branches typed alike inside shard_map: varying over the axes x varies over
    return jax.lax.platform_dependent(
        *args,
        cpu=lambda *a: match_vma(_emulated_ragged(*a, axis_name, max_piece), a[0])[0],
        default=lambda *a: match_vma(jax.lax.ragged_all_to_all(*a, axis_name=axis_name), a[0])[0],
    )


def push_meta(plan: Plan) -> jax.Array:
    """int32 [3, X]: the plan as the push kernels take it (per update its start here, rows, start there)."""
    return jnp.stack([plan.input_offsets_P, plan.send_sizes_P, plan.output_offsets_P]).astype(jnp.int32)


def move_push(x_ND, plan: Plan, out_rows: int, axis_name: str, max_chunk: int) -> jax.Array:
    from xmoe_jax.kernels.push import push_rows  # the kernel's module imports Mosaic GPU

    meta_3X = push_meta(plan)
    num_peers = jax.lax.axis_size(axis_name)  # the plan may hold several updates per peer
    out_MD = push_rows(
        x_ND, meta_3X, out_rows=out_rows, axis_name=axis_name, num_peers=num_peers, max_piece=max_chunk
    )
    return match_vma(out_MD, x_ND)[0]


def move_push_gmm(
    lhs_RF,
    rhs_EFD,
    group_sizes_E,
    plan: Plan,
    out_rows: int,
    axis_name: str,
    max_chunk: int,
    transpose_rhs=False,
):
    """`move_push(gmm(lhs_RF, rhs_EFD, group_sizes_E), plan, ...)` as one kernel: lhs's rows are grouped
    by local expert and the plan holds one update per (peer, local expert) (expert-major arrival's
    reverse plan). Not differentiable by itself (experts.pushed_experts holds its VJP)."""
    from xmoe_jax.kernels.push import gmm_push  # the kernel's module imports Mosaic GPU

    meta_3X = push_meta(plan)
    out_MN = gmm_push(
        lhs_RF, rhs_EFD, group_sizes_E, meta_3X, out_rows=out_rows, axis_name=axis_name,
        num_peers=jax.lax.axis_size(axis_name), max_piece=max_chunk, transpose_rhs=transpose_rhs,
    )  # fmt: skip
    return match_vma(out_MN, lhs_RF)[0]


def move_push_arrive(
    x_ND,
    plan: Plan,
    out_rows: int,
    axis_name: str,
    max_chunk: int,
    rhs_EKN,
    group_sizes_E,
    transpose_rhs=False,
):
    """`(x_MD := move_push(x_ND, plan, ...), gmm(x_MD, rhs_EKN, group_sizes_E))` as one kernel: the plan
    holds one update per (peer, local expert), so the rows land grouped by local expert, and each
    group's GEMM starts when its rows have landed (kernels/push: push_gmm). Not differentiable by
    itself (experts.pushed_experts holds its VJP)."""
    from xmoe_jax.kernels.push import push_gmm  # the kernel's module imports Mosaic GPU

    meta_3X = push_meta(plan)
    x_MD, out_MN = push_gmm(
        x_ND, rhs_EKN, group_sizes_E, meta_3X, out_rows=out_rows, axis_name=axis_name,
        num_peers=jax.lax.axis_size(axis_name), max_piece=max_chunk, transpose_rhs=transpose_rhs,
    )  # fmt: skip
    return match_vma(x_MD, x_ND)[0], match_vma(out_MN, x_ND)[0]


def no_cotangent(plan: Plan) -> Plan:
    """A plan's cotangent in a custom VJP: its integer offsets and sizes have none (float0 zeros)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), plan)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def exchange(
    x_ND, plan: Plan, out_rows: int, in_rows: int, axis_name: str, transport: Transport, max_chunk: int
):
    """Sends `plan.send_sizes_P[j]` rows of x to each peer j; returns the [out_rows, D] receive buffer.

    `max_chunk` bounds the rows one peer sends another (the emulated transport pads to it);
    `in_rows` is x's row count, needed to shape the backward pass's buffer.
    """
    del in_rows
    return transport.move(x_ND, plan, out_rows, axis_name, max_chunk)


def _exchange_fwd(x_ND, plan, out_rows, in_rows, axis_name, transport, max_chunk):
    return exchange(x_ND, plan, out_rows, in_rows, axis_name, transport, max_chunk), plan


def _exchange_bwd(out_rows, in_rows, axis_name, transport, max_chunk, plan, g_MD):
    g_ND = transport.move(g_MD, plan.reverse(), in_rows, axis_name, max_chunk)
    return g_ND, no_cotangent(plan)


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def wire_bytes(
    plan: Plan,
    me: jax.Array,
    row_bytes: int,
    transport: Transport,
    max_chunk: int,
    out_rows: int | None = None,
    decomposed: bool = False,
    updates_per_peer: int = 1,
) -> jax.Array:
    """Bytes this device puts on the wire to other peers in one exchange (rows to itself stay local).

    A transport whose wire is `exact` (`exact`, `ragged`) sends exactly the routed rows (`exact`'s
    CPU emulation pads, but CPU has no wire), or (P-1) whole receive buffers of `out_rows` when XLA
    decomposes its ragged all-to-all (`decomposed`: `parallel.ragged_decomposed`); a `padded` one
    (`emulated`) sends every padded chunk (`max_chunk` rows per update, `updates_per_peer` per peer).
    """
    num_peers = plan.send_sizes_P.shape[0] // updates_per_peer
    if transport.wire == "padded":
        rows = jnp.asarray((num_peers - 1) * updates_per_peer * max_chunk, jnp.float32)
    elif out_rows is not None and decomposed and transport.ragged_preset is not None:
        rows = jnp.asarray((num_peers - 1) * out_rows, jnp.float32)
    else:
        sent_P = per_peer(plan.send_sizes_P, num_peers)
        rows = (sent_P.sum() - sent_P[me]).astype(jnp.float32)
    return rows * row_bytes


def move_rows(
    x_ND, plan: Plan, out_rows: int, axis_name: str, transport: Transport, max_chunk: int
) -> jax.Array:
    """`exchange` without a VJP, for integer metadata that travels with the rows."""
    return transport.move(x_ND, plan, out_rows, axis_name, max_chunk)
