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
rows back exactly where they came from.

Transports, one function (`exchange`), differentiable through a custom VJP whose
backward pass is the reverse exchange:
  ragged    `jax.lax.ragged_all_to_all`: exactly the routed rows on the wire (GPU;
            not implemented on XLA:CPU);
  emulated  a dense `all_to_all` of per-peer chunks padded to a static bound, then
            scattered to the same offsets: moves the same rows to the same places,
            with padding on the wire. Works everywhere; the CPU tests use it.
The third transport, `bucketed`, is not a ragged exchange: pft lays its buffers out as
fixed per-peer chunks sized by the step's buffer bucket and moves them with one dense
`all_to_all` (layouts.py).

What goes on the wire: `ragged` under XLA's default kernel sends the routed rows; under
the `decomposer` preset (launch/xla_flags.py) XLA rewrites it into a dense all-to-all of the
whole receive buffer per peer, so (P-1) x M rows leave each device whatever the routing;
`emulated` sends (P-1) padded chunks. `wire_bytes` reports that, not the routed rows.
Whether the decomposer is in effect is a placement fact settled before tracing
(`parallel.ragged_decomposed`, set by xmoe_jax/resolve.py): nothing here reads XLA flags.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

GPU_BACKENDS = ("gpu", "cuda", "rocm")  # where `auto` means `bucketed`


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
    return Plan(
        input_offsets_P=chunk_starts_PQ[me],
        send_sizes_P=sizes_PQ[me],
        output_offsets_P=offsets_PQ[me],
        recv_sizes_P=sizes_PQ[:, me],
        recv_offsets_P=offsets_PQ[:, me],
        peer_offsets_P=chunk_starts_PQ[:, me],
    )


def resolve_transport(transport: str, backend: str | None = None) -> str:
    """A concrete transport: `auto` -> `bucketed` on GPU (the fastest measured:
    benchmarks/exchange.md), `emulated` elsewhere; the others unchanged. The apps settle `auto`
    once at start-up (xmoe_jax/resolve.py); direct library calls that leave it get the rule for
    JAX's backend (`backend` None)."""
    if transport != "auto":
        return transport
    return "bucketed" if (backend or jax.default_backend()) in GPU_BACKENDS else "emulated"


def _ragged(x_ND, plan: Plan, out_rows: int, axis_name: str, max_chunk: int) -> jax.Array:
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


def _emulated(x_ND, plan: Plan, out_rows: int, axis_name: str, max_chunk: int) -> jax.Array:
    rows_C = jnp.arange(max_chunk, dtype=jnp.int32)
    src_PC = plan.input_offsets_P[:, None] + rows_C[None, :]
    src_PC = jnp.where(rows_C[None, :] < plan.send_sizes_P[:, None], src_PC, x_ND.shape[0])
    chunks_PCD = x_ND.at[src_PC].get(mode="fill", fill_value=0)
    recv_PCD = jax.lax.all_to_all(chunks_PCD, axis_name, 0, 0)
    dst_PC = plan.recv_offsets_P[:, None] + rows_C[None, :]
    dst_PC = jnp.where(rows_C[None, :] < plan.recv_sizes_P[:, None], dst_PC, out_rows)
    out_MD = jnp.zeros((out_rows, x_ND.shape[1]), x_ND.dtype)
    return out_MD.at[dst_PC.reshape(-1)].set(recv_PCD.reshape(-1, x_ND.shape[1]), mode="drop")


_TRANSPORTS = {"ragged": _ragged, "emulated": _emulated}


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def exchange(x_ND, plan: Plan, out_rows: int, in_rows: int, axis_name: str, transport: str, max_chunk: int):
    """Sends `plan.send_sizes_P[j]` rows of x to each peer j; returns the [out_rows, D] receive buffer.

    `max_chunk` bounds the rows one peer sends another (the emulated transport pads to it);
    `in_rows` is x's row count, needed to shape the backward pass's buffer.
    """
    del in_rows
    return _TRANSPORTS[transport](x_ND, plan, out_rows, axis_name, max_chunk)


def _exchange_fwd(x_ND, plan, out_rows, in_rows, axis_name, transport, max_chunk):
    return exchange(x_ND, plan, out_rows, in_rows, axis_name, transport, max_chunk), plan


def _exchange_bwd(out_rows, in_rows, axis_name, transport, max_chunk, plan, g_MD):
    g_ND = _TRANSPORTS[transport](g_MD, plan.reverse(), in_rows, axis_name, max_chunk)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), plan)
    return g_ND, zeros


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def wire_bytes(
    plan: Plan,
    me: jax.Array,
    row_bytes: int,
    transport: str,
    max_chunk: int,
    out_rows: int | None = None,
    decomposed: bool = False,
) -> jax.Array:
    """Bytes this device puts on the wire to other peers in one exchange (rows to itself stay local).

    `ragged` sends exactly the routed rows, or (P-1) whole receive buffers of `out_rows` when XLA
    decomposes it (`decomposed`: `parallel.ragged_decomposed`); `emulated` sends every padded chunk.
    """
    num_peers = plan.send_sizes_P.shape[0]
    if transport == "emulated":
        rows = jnp.asarray((num_peers - 1) * max_chunk, jnp.float32)
    elif out_rows is not None and decomposed:
        rows = jnp.asarray((num_peers - 1) * out_rows, jnp.float32)
    else:
        rows = (plan.send_sizes_P.sum() - plan.send_sizes_P[me]).astype(jnp.float32)
    return rows * row_bytes


def move_rows(x_ND, plan: Plan, out_rows: int, axis_name: str, transport: str, max_chunk: int) -> jax.Array:
    """`exchange` without a VJP, for integer metadata that travels with the rows."""
    return _TRANSPORTS[transport](x_ND, plan, out_rows, axis_name, max_chunk)
