"""The push exchange as a Pallas Mosaic-GPU kernel: each GPU writes its rows straight into its peers'
receive buffers over NVLink and signals them; no NCCL, exactly the routed bytes on the wire.

Legend: N send rows, M receive rows, D row width, P peers on the exchange axis, X = P * U updates
(U per peer; update x goes to peer x // U), G thread blocks (CTAs), B rows per block copy, S stages.

One kernel launch per exchange, on every device of the axis at once (one process drives all GPUs
of a host: XLA hands each Mosaic kernel its parameters' addresses on every peer, so
`plgpu.remote_ref(out, peer)` is the peer's receive buffer; jax's collective_matmul_mgpu.py is the
pattern). Steps, per device:
  1. update x moves sizes[x] rows, x_ND[src[x]:] -> peer (x // U)'s out_MD[dst[x]:]. Its full
     B-row blocks are dealt round-robin to the G CTAs; the tail (< B rows) goes to CTA x % G as a
     ladder of power-of-two copies (B/2, ..., 1 rows), since a copy's shape is static;
  2. a block goes HBM -> shared memory (a bulk copy, waited on a barrier) -> the peer's HBM (a
     bulk copy into peer memory); S shared-memory stages keep the next load and S - 2 peer writes
     in flight. Each device starts with the updates for peer me + 1 and walks round, so the
     devices' writes form a rotation instead of all landing on peer 0 first;
  3. when a CTA's writes have all landed, it adds 1 to every peer's semaphore; CTA 0 of each
     device waits for G * P signals (every CTA of every device is done writing to it), so the
     kernel ends only when its receive buffer is complete.
Rows of out_MD that no update targets are not written (undefined). Only G CTAs copy, so GEMMs can
run beside it on the other SMs. XLA runs a cross-device barrier before a kernel that talks to
peers, so one exchange's writes never reach a buffer a peer still reads from the previous one.

Needs: NVIDIA Hopper or later, one process for all GPUs of the axis (not one per GPU: that needs
NVSHMEM, which jax 0.11.2's XLA refuses), rows of a multiple of 16 bytes (bulk copies), and
NVLink multicast is not used. The CPU stand-in with the same semantics is api.py's reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

NUM_CTAS = 64  # CTAs that copy (the rest of the SMs stay free for GEMMs); tuned by bench_exchange.py
NUM_STAGES = 4  # shared-memory stages per CTA (at least 2: one loading while one writes)
BLOCK_BYTES = 32 * 1024  # target bytes per block copy (B rows)
ROW_ALIGN_BYTES = 16  # bulk copies move multiples of 16 bytes


def block_rows(row_bytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """B: the largest power of two of rows whose copy stays within `block_bytes` (at least 1)."""
    rows = max(1, block_bytes // max(row_bytes, 1))
    return 1 << (rows.bit_length() - 1)


def push_loop(
    meta_ref,
    x_ref,
    out_ref,
    smem_ref,
    bars_ref,
    *,
    cta,
    num_ctas: int,
    axis_name,
    num_peers: int,
    updates_per_peer: int,
    rows: int,
    stages: int,
    group_done=None,
):
    """CTA `cta` of `num_ctas`: its share of every update of `meta_ref` (steps 1 and 2 of the module
    docstring), through its `smem_ref` stages. Without `group_done`, update by update from peer me + 1
    round; with it, group-major (local expert g = x % U to every peer, me + 1 first, then g + 1) and
    `group_done(g)` after this CTA's copies of group g were issued (gmm/mgpu_ws.py's arrive prologue:
    the GEMM waits per group)."""
    num_updates = num_peers * updates_per_peer
    me = lax.axis_index(axis_name)

    def load(src_row, count: int, slot):
        plgpu.copy_gmem_to_smem(
            x_ref.at[pl.ds(src_row, count)],
            smem_ref.at[slot, pl.ds(0, count)],
            bars_ref.at[slot],
            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
        )

    def store(slot, count: int, peer_out, dst_row):
        plgpu.barrier_wait(bars_ref.at[slot])
        plgpu.copy_smem_to_gmem(smem_ref.at[slot, pl.ds(0, count)], peer_out.at[pl.ds(dst_row, count)])

    def blocks(num, src, dst, peer_out, step, rank):
        """This CTA's `num` full blocks of one update (it is the update's CTA `rank`), loads one block
        ahead of the peer writes."""

        def first(j):
            return (rank + j * num_ctas) * rows

        @pl.when(num > 0)
        def _():
            plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)  # stage step % S is free
            load(src + first(0), rows, lax.rem(step, stages))

        def body(j, step):
            @pl.when(j + 1 < num)
            def _():  # stage (step + 1) % S: its last write was issued S - 1 writes ago
                plgpu.wait_smem_to_gmem(stages - 2, wait_read_only=True)
                load(src + first(j + 1), rows, lax.rem(step + 1, stages))

            store(lax.rem(step, stages), rows, peer_out, dst + first(j))
            return step + 1

        return lax.fori_loop(0, num, body, step)

    def tail_copy(src_row, dst_row, peer_out, count: int, step):
        slot = lax.rem(step, stages)
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
        load(src_row, count, slot)
        store(slot, count, peer_out, dst_row)
        return step + 1

    def move(x, step):
        src, size, dst = meta_ref[0, x], meta_ref[1, x], meta_ref[2, x]
        peer_out = plgpu.remote_ref(out_ref, {axis_name: x // updates_per_peer})
        full = size // rows
        # group-major (small updates, each group waited on): update x's blocks start at CTA x % G, so
        # the first blocks of consecutive updates do not all fall on CTA 0; its tail goes to the CTA
        # before that one, which holds the fewest of its blocks
        rank = lax.rem(cta - lax.rem(x, num_ctas) + num_ctas, num_ctas) if group_done else cta
        tail_rank = num_ctas - 1 if group_done else lax.rem(x, num_ctas)
        mine = lax.div(jnp.maximum(full - rank, 0) + num_ctas - 1, jnp.int32(num_ctas))
        step = blocks(mine, src, dst, peer_out, step, rank)
        tail = size - full * rows
        done = full * rows
        count = rows // 2
        while count >= 1:  # the tail as power-of-two copies, by one CTA (static ladder)
            take = (rank == tail_rank) & ((tail & count) != 0)
            step = lax.cond(
                take,
                functools.partial(lambda c, o, s: tail_copy(src + o, dst + o, peer_out, c, s), count, done),
                lambda s: s,
                step,
            )
            done = done + (tail & count)
            count //= 2
        return step

    if group_done is None:
        # devices walk the updates from different peers (me + 1 first), so at any moment each GPU
        # is written by about one other instead of all of them writing to peer 0 together
        def update(i, step):
            return move(lax.rem(i + (me + 1) * updates_per_peer, num_updates), step)

        return lax.fori_loop(0, num_updates, update, jnp.int32(0))

    def group(g, step):
        def peer(j, step):
            return move(lax.rem(me + 1 + j, num_peers) * updates_per_peer + g, step)

        step = lax.fori_loop(0, num_peers, peer, step)
        group_done(g)
        return step

    return lax.fori_loop(0, updates_per_peer, group, jnp.int32(0))


def _kernel(meta_ref, x_ref, out_ref, smem_ref, bars_ref, *, axis_name, num_peers, num_ctas, **loop):
    cta = lax.axis_index("cta")
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    push_loop(
        meta_ref, x_ref, out_ref, smem_ref, bars_ref, cta=cta, num_ctas=num_ctas, axis_name=axis_name,
        num_peers=num_peers, **loop,
    )  # fmt: skip
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # every write of this CTA has landed
    for peer in range(num_peers):
        pl.semaphore_signal(sem, 1, device_id={axis_name: peer})

    @pl.when(cta == 0)
    def _():
        pl.semaphore_wait(sem, num_ctas * num_peers)


def push_rows(
    x_ND: jax.Array,
    meta_3X: jax.Array,
    *,
    out_rows: int,
    axis_name: str,
    num_peers: int,
    num_ctas: int = NUM_CTAS,
    stages: int = NUM_STAGES,
    block_bytes: int = BLOCK_BYTES,
) -> jax.Array:
    """[out_rows, D]: the rows peers pushed here. `meta_3X` int32: rows (src offset, size, dst
    offset) of the X = P * U updates, update x to peer x // U. Runs inside a shard_map over
    `axis_name` (P devices), one process driving them all."""
    num_rows, dim = x_ND.shape
    row_bytes = dim * jnp.dtype(x_ND.dtype).itemsize
    if row_bytes % ROW_ALIGN_BYTES:
        raise ValueError(f"push_rows needs rows of a multiple of {ROW_ALIGN_BYTES} bytes, got {row_bytes}")
    num_updates = meta_3X.shape[1]
    if num_updates % num_peers:
        raise ValueError(f"meta_3X has {num_updates} updates, not a multiple of {num_peers} peers")
    rows = min(block_rows(row_bytes, block_bytes), 1 << max(num_rows, 1).bit_length() - 1)
    kernel = functools.partial(
        _kernel,
        axis_name=axis_name,
        num_peers=num_peers,
        updates_per_peer=num_updates // num_peers,
        num_ctas=num_ctas,
        rows=rows,
        stages=stages,
    )
    out_MD = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((out_rows, dim), x_ND.dtype),
        grid=(num_ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((stages, rows, dim), x_ND.dtype),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        ],
        kernel_name="xmoe_push",
    )(meta_3X, x_ND)
    # XLA:GPU's dynamic-slice fusion (on by default in jax 0.11.2) folds a custom call whose result a
    # dynamic-update-slice stores (the layer scan stacking a saved residual: remat=save_exchange) into
    # that store, cloning the call when the result has other users: every exchange ran twice in the
    # forward pass (6 kernels per layer and micro-batch where the program has 4; benchmarks/exchange.md).
    # Behind a barrier the store takes the rows as a plain copy.
    return lax.optimization_barrier(out_MD)
