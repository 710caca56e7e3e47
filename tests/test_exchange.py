"""The ragged row exchange (xmoe_jax.moe.exchange) inside a small shard_map, against NumPy.

A Plan is built by hand from random per-pair sizes, with the chunks placed in random order and
with gaps in both the send and the receive buffers, so that every offset matters. One compiled
function per (peers, direction); the sizes and offsets are data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec

from xmoe_jax.moe.exchange import Plan, exchange, split_updates, wire_bytes
from xmoe_jax.moe.transports import choose, get

D = 8  # row width
N = 32  # send-buffer rows per device
M = 40  # receive-buffer rows per device
MAX_CHUNK = 6  # rows one device sends another, at most
AXIS = "peers"


def _layout(sizes: np.ndarray, capacity: int, rng: np.random.Generator) -> np.ndarray:
    """Offsets of chunks `sizes[j]` in a buffer of `capacity` rows: random order, random gaps."""
    peers = sizes.shape[0]
    gaps = rng.multinomial(capacity - int(sizes.sum()), np.ones(peers + 1) / (peers + 1))
    offsets = np.zeros(peers, np.int32)
    pos = 0
    for slot, j in enumerate(rng.permutation(peers)):
        pos += gaps[slot]
        offsets[j] = pos
        pos += sizes[j]
    return offsets


def _random_plan(peers: int, seed: int):
    """S[i, j] rows i -> j; I[i, j] where they sit in i's send buffer; R[j, i] where they land at j."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, MAX_CHUNK + 1, (peers, peers)).astype(np.int32)
    sizes[rng.random((peers, peers)) < 0.25] = 0  # many empty pairs
    sizes[0, :] = 0  # device 0 sends nothing
    sizes[:, 1] = 0  # device 1 receives nothing
    sizes[2, 3] = MAX_CHUNK  # a full chunk
    assert sizes.sum(1).max() <= N and sizes.sum(0).max() <= M
    in_off = np.stack([_layout(sizes[i], N, rng) for i in range(peers)])  # [src, dst]
    recv_off = np.stack([_layout(sizes[:, j], M, rng) for j in range(peers)])  # [dst, src]
    plan = Plan(
        input_offsets_P=in_off,
        send_sizes_P=sizes,
        output_offsets_P=recv_off.T,  # [src, dst]: where my rows land at dst
        recv_sizes_P=sizes.T,  # [dst, src]
        recv_offsets_P=recv_off,
        peer_offsets_P=in_off.T,  # [dst, src]: where my incoming rows sit in src's buffer
    )
    return sizes, in_off, recv_off, plan  # plan rows are per device


def _expected(x_PND: np.ndarray, sizes, in_off, recv_off) -> np.ndarray:
    peers = sizes.shape[0]
    out = np.zeros((peers, M, D), x_PND.dtype)
    for i in range(peers):
        for j in range(peers):
            n = sizes[i, j]
            out[j, recv_off[j, i] : recv_off[j, i] + n] = x_PND[i, in_off[i, j] : in_off[i, j] + n]
    return out


def _sent_mask(sizes, in_off) -> np.ndarray:
    peers = sizes.shape[0]
    mask = np.zeros((peers, N), bool)
    for i in range(peers):
        for j in range(peers):
            mask[i, in_off[i, j] : in_off[i, j] + sizes[i, j]] = True
    return mask


@functools.cache
def _mesh(peers: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:peers]), (AXIS,), axis_types=(AxisType.Auto,))


# emulated: the padded dense all-to-all; exact: the split ragged plan (XLA:CPU runs it through
# the exact emulation of ragged_all_to_all's semantics, update by update)
TRANSPORTS = ("emulated", "exact", "push")  # push: its XLA reference on CPU


@functools.cache
def _exchange_fn(peers: int, in_rows: int, out_rows: int, reverse: bool = False, transport: str = "emulated"):
    """x [P*in_rows, D], plan of [P, P] arrays -> [P*out_rows, D], one device per row block."""

    def body(x_ND, *plan_arrays):
        plan = Plan(*(a[0] for a in plan_arrays))
        if reverse:
            plan = plan.reverse()
        return exchange(x_ND, plan, out_rows, in_rows, AXIS, get(transport), MAX_CHUNK)

    spec = PartitionSpec(AXIS)
    fn = jax.shard_map(body, mesh=_mesh(peers), in_specs=(spec,) * 7, out_specs=spec)
    return jax.jit(fn)


@functools.cache
def _grad_fn(peers: int, transport: str = "emulated"):
    fwd = _exchange_fn(peers, N, M, transport=transport)

    def loss(x, g, plan):
        return jnp.sum(fwd(x, *plan) * g)

    return jax.jit(jax.grad(loss))


def _inputs(peers: int, seed: int):
    sizes, in_off, recv_off, plan = _random_plan(peers, seed)
    x_PND = np.random.default_rng(seed + 1000).standard_normal((peers, N, D)).astype(np.float32) + 1.0
    return sizes, in_off, recv_off, plan, x_PND


CASES = [(4, 0), (4, 1), (4, 2), (8, 3), (8, 4)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("peers, seed", CASES)
def test_exchange_delivers_rows_to_offsets(peers: int, seed: int, transport: str) -> None:
    sizes, in_off, recv_off, plan, x_PND = _inputs(peers, seed)
    out = _exchange_fn(peers, N, M, transport=transport)(x_PND.reshape(-1, D), *plan)
    want = _expected(x_PND, sizes, in_off, recv_off)
    np.testing.assert_array_equal(np.asarray(out).reshape(peers, M, D), want)  # unsent rows stay 0
    assert not np.asarray(out).reshape(peers, M, D)[1].any()  # device 1 receives nothing


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("peers, seed", CASES)
def test_reverse_plan_round_trip(peers: int, seed: int, transport: str) -> None:
    sizes, in_off, recv_off, plan, x_PND = _inputs(peers, seed)
    out = _exchange_fn(peers, N, M, transport=transport)(x_PND.reshape(-1, D), *plan)
    back = _exchange_fn(peers, M, N, reverse=True, transport=transport)(out, *plan)
    want = np.where(_sent_mask(sizes, in_off)[..., None], x_PND, 0.0)
    np.testing.assert_array_equal(np.asarray(back).reshape(peers, N, D), want)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("peers, seed", CASES)
def test_gradient_is_reverse_exchange(peers: int, seed: int, transport: str) -> None:
    sizes, in_off, recv_off, plan, x_PND = _inputs(peers, seed)
    g_PMD = np.random.default_rng(seed + 7).standard_normal((peers, M, D)).astype(np.float32)
    grad = _grad_fn(peers, transport)(x_PND.reshape(-1, D), g_PMD.reshape(-1, D), plan)
    back = _exchange_fn(peers, M, N, reverse=True)(g_PMD.reshape(-1, D), *plan)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(back))
    # and from first principles: d x[i, in_off[i,j] + r] = g[j, recv_off[j,i] + r]
    want = np.zeros((peers, N, D), np.float32)
    for i in range(peers):
        for j in range(peers):
            n = sizes[i, j]
            want[i, in_off[i, j] : in_off[i, j] + n] = g_PMD[j, recv_off[j, i] : recv_off[j, i] + n]
    np.testing.assert_array_equal(np.asarray(grad).reshape(peers, N, D), want)


def test_split_updates_cover_each_chunk_in_order():
    """Pieces are consecutive, cover the chunk exactly, and differ by at most one row (the first
    size % k pieces get the extra row), so sender and receiver split a chunk identically."""
    sizes, offsets = jnp.asarray([0, 5, 13, 4], jnp.int32), jnp.asarray([7, 0, 20, 3], jnp.int32)
    piece, start = (np.asarray(a).reshape(4, 4) for a in split_updates(sizes, offsets, 4))
    np.testing.assert_array_equal(piece, [[0, 0, 0, 0], [2, 1, 1, 1], [4, 3, 3, 3], [1, 1, 1, 1]])
    np.testing.assert_array_equal(start[:, 0], offsets)
    np.testing.assert_array_equal(start[:, 1:], start[:, :-1] + piece[:, :-1])
    np.testing.assert_array_equal(piece.sum(1), sizes)


@pytest.mark.parametrize("peers, seed", [(4, 0), (8, 3)])
def test_wire_bytes(peers: int, seed: int) -> None:
    sizes, _, _, plan, _ = _inputs(peers, seed)
    row_bytes = D * 4
    for me in range(peers):
        mine = Plan(*(jnp.asarray(a[me]) for a in plan))
        ragged = wire_bytes(mine, jnp.int32(me), row_bytes, get("ragged"), MAX_CHUNK)
        emulated = wire_bytes(mine, jnp.int32(me), row_bytes, get("emulated"), MAX_CHUNK)
        assert float(ragged) == (sizes[me].sum() - sizes[me, me]) * row_bytes  # other peers only
        # decomposed by XLA (parallel.ragged_decomposed): a whole M-row receive buffer per other peer
        decomposed = wire_bytes(mine, jnp.int32(me), row_bytes, get("ragged"), MAX_CHUNK, M, decomposed=True)
        assert float(decomposed) == (peers - 1) * M * row_bytes
        assert float(wire_bytes(mine, jnp.int32(me), row_bytes, get("ragged"), MAX_CHUNK, M)) == float(ragged)
        assert float(wire_bytes(mine, jnp.int32(me), row_bytes, get("exact"), MAX_CHUNK, M)) == float(ragged)
        assert float(emulated) == (peers - 1) * MAX_CHUNK * row_bytes  # every padded chunk
    # a device that sends only to itself puts nothing on the wire with ragged
    only_self = Plan(*(jnp.asarray(a[2]) for a in plan))._replace(
        send_sizes_P=jnp.zeros(peers, jnp.int32).at[2].set(5)
    )
    assert float(wire_bytes(only_self, jnp.int32(2), row_bytes, get("ragged"), MAX_CHUNK)) == 0.0


def test_resolve_transport() -> None:
    assert jax.default_backend() == "cpu"
    assert choose("auto").name == "emulated"
    assert choose("ragged").name == "ragged"
    assert choose("emulated").name == "emulated"
