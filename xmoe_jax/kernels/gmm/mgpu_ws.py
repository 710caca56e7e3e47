"""Our grouped GEMM for Hopper: a warp-specialized Pallas Mosaic-GPU kernel (TMA loads, wgmma).

Legend: R grouped rows, K contraction, N output columns, E experts (groups), I work items,
T = 2 compute warpgroups (consumers), one memory warpgroup (producer).

    out_RN = gmm_ws(lhs_RK, rhs_EKN, group_sizes_E, out_dtype=..., config=WsConfig(...))
    # out[r] = lhs[r] @ rhs[group(r)] for r < sum(group_sizes); rows past the sum unwritten

Why: on one GPU the expert GEMMs are the limit (benchmarks/fused.md): our Triton-lowered Pallas kernel
runs 433-483 TFLOP/s forward where CUTLASS's `torch._grouped_mm` runs 589-637 on the same rows, and JAX's
bundled Mosaic `ragged_dot` (gmm/mgpu.py) one warpgroup with no producer runs 36-45% of a dense matmul.
This kernel has the structure of JAX's dense Hopper matmul (`hopper_matmul_mgpu.py`): a persistent grid of
one CTA per SM, a memory warpgroup streaming lhs and rhs tiles by TMA through a ring of shared-memory
stages, and two compute warpgroups each accumulating half the CTA tile with wgmma; it adds groups.

Groups: the work list is gmm's (metadata.py): item i is a (group, row tile) pair with a non-empty
overlap, computed on the device before the launch and packed as int32 [4, I] (group, row tile, first
valid row of the tile, valid rows). The CTA loop walks (item, N tile) pairs; an idle item (past the real
count) is skipped by all three warpgroups alike. A tile that straddles a group boundary is computed with
its group's weights over all its rows (TMA loads whole tiles; rows past R read zeros) and only the rows of
its group are stored: from an unswizzled shared-memory tile as a ladder of power-of-two-row TMA stores
(the static shapes a bulk copy needs; JAX's ragged_dot stores the same way). Rows past sum(group_sizes)
are neither computed nor stored.

Needs: NVIDIA Hopper, equal 16-bit input dtypes, K % tile_k == 0, N % (CTA tile N) == 0. No row
indices (Hopper's TMA has no gather): an indexed call takes the Pallas kernel (backends.py).

Push epilogue (`push=PushSpec(...)`, kernels/push: `gmm_push`): the same GEMM, whose output rows go
straight to the peers they came from instead of to a local buffer, so the return exchange runs
under the GEMM's own main loop. The rows are the compact layout's receive buffer grouped by local
expert (expert-major arrival): within group g the rows of source p form one segment, update
x = p * U + g of the reverse plan `seg_3X` (its start here, its rows, where they go on p). Each
warpgroup cuts its stored rows at the segment boundaries and sends each piece into peer p's
[out_rows, N] output through `plgpu.remote_ref` (a bulk store over NVLink; to itself, a local one).
When a compute warpgroup's stores have landed it signals every peer once; the kernel ends on each
device when its first CTA has counted 2 x CTAs x P signals (every warpgroup of every device is done
writing to it). One process must drive every GPU of the axis (the peers' addresses reach one
process only), as for the push kernel.

Arrive prologue (`arrive_gmm_ws`, kernels/push: `push_gmm`): the exchange before a GEMM and the GEMM
in one launch, so the rows of local expert g are multiplied while those of g + 1, ... are still on
the wire. The grid's first `ArriveSpec.push_ctas` CTAs run the push kernel's loop (push/mgpu.py,
`push_loop`) group-major: local expert g to every peer, then g + 1. When a CTA's copies of group g
have landed it adds 1 to semaphore g on every peer. The other CTAs run the GEMM over the receive
buffer the peers fill (this kernel's first output), in the persistent loop above; before a work item
of group g they wait until semaphore g holds P x push_ctas (every CTA of every device has written its
part of g; the wait does not consume, as in JAX's collective_matmul_mgpu.py). Before it ends, each
device waits for every group's count, so no signal reaches the semaphores after the kernel.
Untested on a GPU as of its writing (docs/exchange.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from xmoe_jax.kernels.gmm.metadata import make_group_metadata


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Tile and launch parameters. `split`: how the two compute warpgroups divide the CTA tile: `m`
    (each tile_m rows of 2 * tile_m, all tile_n columns) or `n` (all tile_m rows, tile_n of 2 * tile_n)."""

    tile_m: int = 64
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    split: Literal["m", "n"] = "m"
    snake_width: int = 8  # planar snake over (item, N tile): rows of this many items per sweep
    in_flight: int = 0  # wgmmas left running when a step returns (its stage is released that much later)
    epi_n: int | None = None  # columns per epilogue store (None: tile_n); smaller frees shared memory

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.split == "n" else 1)


@dataclasses.dataclass(frozen=True)
class PushSpec:
    """Where the push epilogue sends rows: the devices of `axis_name` (P = num_peers), U updates per
    peer (the local experts), into an output of `out_rows` rows on each."""

    axis_name: str
    num_peers: int
    updates_per_peer: int
    out_rows: int


@dataclasses.dataclass(frozen=True)
class ArriveSpec:
    """The exchange an arrive prologue runs (module docstring): P = num_peers devices of `axis_name`,
    U updates per peer (the local experts), `recv_rows` rows received on each; `push_ctas` CTAs copy,
    through `push_stages` shared-memory stages of `push_block_bytes`."""

    axis_name: str
    num_peers: int
    updates_per_peer: int
    recv_rows: int
    push_ctas: int = 16
    # the push kernel's own (measured there); its shared memory is no more than the GEMM's ring, and the
    # two scopes are siblings, so the larger is allocated
    push_stages: int = 4
    push_block_bytes: int = 32 * 1024


def shape_reason(dtype, k_dim: int, n_dim: int, config: WsConfig, num_rows: int | None = None) -> str | None:
    """Why the kernel cannot take this call, or None."""
    if num_rows is not None and (num_rows % 8 or num_rows < config.cta_m):
        # Mosaic tiles a GMEM operand's rows by 8 (a trace-time error otherwise, seen on an H200)
        return f"{num_rows} rows: needs a multiple of 8 and at least one {config.cta_m}-row tile"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bfloat16/float16 inputs, got {jnp.dtype(dtype)}"
    if k_dim % config.tile_k:
        return f"K={k_dim} is not a multiple of tile_k={config.tile_k}"
    if n_dim % config.cta_n:
        return f"N={n_dim} is not a multiple of the CTA's {config.cta_n} columns"
    epi_n = config.epi_n or config.tile_n
    if config.tile_n % epi_n or epi_n * 2 % 128:  # 16-bit outputs: 64 columns at least
        # a row slice of the output tile is a bulk store's source: rows of 128 bytes (32 columns faulted)
        return f"epi_n={epi_n} must divide tile_n={config.tile_n} in rows of a multiple of 128 bytes"
    return None


def work_items(group_sizes_E: jax.Array, num_rows: int, cta_m: int) -> jax.Array:
    """int32 [4, I]: per work item its group, row tile, first row to store and rows to store (0: idle)."""
    meta = make_group_metadata(group_sizes_E, num_rows, cta_m)
    group_I, tile_I = meta.item_group_I, meta.item_tile_I
    lo_I = jnp.maximum(meta.group_start_G[group_I], tile_I * cta_m)
    hi_I = jnp.minimum(meta.group_end_G[group_I], (tile_I + 1) * cta_m)
    count_I = jnp.maximum(hi_I - lo_I, 0)
    num_groups = group_sizes_E.shape[0]
    return jnp.stack([jnp.minimum(group_I, num_groups - 1), tile_I, lo_I, count_I]).astype(jnp.int32)


def _num_sms() -> int:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132)


def _kernel(
    meta_gmem,
    a_gmem,
    b_gmem,
    *refs,
    config: WsConfig,
    num_items: int,
    num_ctas: int,
    transpose_rhs: bool,
    push: PushSpec | None,
    arrive: ArriveSpec | None = None,
):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    if arrive is not None:  # (work items, send rows, rhs, plan) -> (receive buffer, output)
        send_gmem = a_gmem
        plan_gmem, a_gmem, out_gmem = refs
        seg_gmem = None
    else:
        seg_gmem, out_gmem = refs if push else (None, *refs)
    dtype = a_gmem.dtype
    out_dtype = out_gmem.dtype
    k_dim = a_gmem.shape[1]
    n_dim = out_gmem.shape[1]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_m, cta_n = config.cta_m, config.cta_n
    n_iters, k_iters = n_dim // cta_n, k_dim // tile_k
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(tile_k * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    b_block = (cta_n, tile_k) if transpose_rhs else (tile_k, cta_n)
    epi_n = config.epi_n or tile_n

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, tile_k),
                    lambda k: (0, k),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=config.in_flight,
                ),
                plgpu.BlockSpec(
                    b_block,
                    (lambda k: (0, k)) if transpose_rhs else (lambda k: (k, 0)),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=config.in_flight,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731  the functions do not change the allocations

    def rows_to_store(group, lo, count):
        """(target ref, first row here, rows, first row there) per piece of rows [lo, lo + count)."""
        if push is None:
            return [(out_gmem, lo, count, lo)]
        pieces = []
        for peer in range(push.num_peers):  # the segment of each source within this group
            x = peer * push.updates_per_peer + group
            start, size, dst = seg_gmem[0, x], seg_gmem[1, x], seg_gmem[2, x]
            a, b = jnp.maximum(lo, start), jnp.minimum(lo + count, start + size)
            target = plgpu.remote_ref(out_gmem, {push.axis_name: peer})
            pieces.append((target, a, jnp.maximum(b - a, 0), dst + a - start))
        return pieces

    def store_rows(out_smem, wg, target, first, count, dst, col):
        """out_smem[wg] rows [first, first + count) -> target rows [dst, dst + count), as a ladder of
        power-of-two-row bulk stores (a copy's shape is static)."""
        size = tile_m
        while size >= 1:

            @pl.when((count & size) != 0)
            def _store(first=first, dst=dst, size=size):
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg, pl.ds(first, size)], target.at[pl.ds(dst, size), pl.ds(col, epi_n)]
                )

            first, dst = first + (count & size), dst + (count & size)
            size //= 2

    num_tiles = num_items * n_iters
    if arrive is None:

        def tile_loop(body):  # every CTA: tiles cta, cta + CTAs, ...
            plgpu.nd_loop((num_tiles,), collective_axes="cluster_grid")(lambda info: body(info.index[0]))

    else:
        cta = lax.axis_index("cluster_grid")
        gemm_ctas = num_ctas - arrive.push_ctas
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((arrive.updates_per_peer,)))
        arrived = arrive.num_peers * arrive.push_ctas  # every copying CTA of every device, per group

        def tile_loop(body):  # the CTAs past the copying ones
            pl.loop(cta - arrive.push_ctas, num_tiles, step=gemm_ctas)(body)

        _arrive_push(send_gmem, plan_gmem, a_gmem, sems, cta, arrive)

    def gemm_tiles(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")

        @tile_loop
        def _tile_loop(lin):
            item, n_idx = plgpu.planar_snake(lin, (num_items, n_iters), 1, config.snake_width)
            group, tile = meta_gmem[0, item], meta_gmem[1, item]
            row_lo, rows = meta_gmem[2, item], meta_gmem[3, item]

            @pl.when(rows > 0)
            def _work():
                if arrive is not None:  # group g's rows have landed from every peer
                    pl.semaphore_wait(sems.at[group], arrived, decrement=False)
                cta_rows = pl.ds(tile * cta_m, cta_m)
                cta_cols = pl.ds(n_idx * cta_n, cta_n)
                if config.split == "m":
                    wg_rows, wg_cols = pl.ds(wg * tile_m, tile_m), slice(None)
                    wg_row0, wg_col0 = tile * cta_m + wg * tile_m, n_idx * cta_n
                else:
                    wg_rows, wg_cols = slice(None), pl.ds(wg * tile_n, tile_n)
                    wg_row0, wg_col0 = tile * cta_m, n_idx * cta_n + wg * tile_n
                # this warpgroup's rows to store: [first, first + count) of its tile_m
                first = jnp.clip(row_lo - wg_row0, 0, tile_m)
                count = jnp.clip(row_lo + rows - wg_row0, 0, tile_m) - first

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(out_dtype)
                        pieces = rows_to_store(group, wg_row0 + first, count)
                        for col in range(0, tile_n, epi_n):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read out_smem
                            out_smem[wg] = acc[:, col : col + epi_n]
                            plgpu.commit_smem()
                            for target, lo, size, dst in pieces:
                                store_rows(out_smem, wg, target, lo - wg_row0, size, dst, wg_col0 + col)

                def mma_body(_, a_smem, b_smem, acc_ref):
                    b_tile = b_smem.at[wg_cols] if transpose_rhs else b_smem.at[:, wg_cols]
                    if transpose_rhs:
                        b_tile = b_tile.transpose((1, 0))  # plgpu.transpose_ref: gone in jax 0.12.1
                    plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_tile)
                    plgpu.wgmma_wait(config.in_flight)
                    return acc_ref

                b_cols = b_gmem.at[group]
                b_cols = b_cols.at[cta_cols, :] if transpose_rhs else b_cols.at[:, cta_cols]
                get_pipeline(mma_body, compute_context)(
                    a_gmem.at[cta_rows, :], b_cols, allocations=pipeline_allocs
                )

    scope = functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0]),
        out_smem=plgpu.SMEM((2, tile_m, epi_n), out_dtype),
        collective_axes="wg",
    )
    if arrive is None:
        scope(gemm_tiles)
    else:
        pl.when(cta >= arrive.push_ctas)(lambda: scope(gemm_tiles))

    if push is None:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this warpgroup's rows have landed
    wg = lax.axis_index("wg")
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

    @pl.when(wg < 2)  # the compute warpgroups store; each tells every peer it is done
    def _signal():
        for peer in range(push.num_peers):
            pl.semaphore_signal(sem, 1, device_id={push.axis_name: peer})

    @pl.when((lax.axis_index("cluster_grid") == 0) & (wg == 0))
    def _wait():  # every compute warpgroup of every device has written here
        pl.semaphore_wait(sem, 2 * num_ctas * push.num_peers)


def _arrive_push(send_gmem, plan_gmem, recv_gmem, sems, cta, arrive: ArriveSpec):
    """The arrive prologue's copying CTAs (module docstring): warpgroup 0 of CTAs [0, push_ctas) pushes
    this device's send rows group-major and signals group g on every peer once its copies of g have
    landed; CTA 0 then waits until every group is complete here."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    from xmoe_jax.kernels.push import mgpu as push_mgpu

    num_rows, dim = send_gmem.shape
    rows = push_mgpu.block_rows(dim * jnp.dtype(send_gmem.dtype).itemsize, arrive.push_block_bytes)
    rows = min(rows, 1 << max(num_rows, 1).bit_length() - 1)  # no copy larger than the send buffer
    axis, peers = arrive.axis_name, arrive.num_peers

    def group_done(g):
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this CTA's copies of group g have landed
        for peer in range(peers):
            pl.semaphore_signal(sems.at[g], 1, device_id={axis: peer})

    @pl.when(cta < arrive.push_ctas)
    def _copying_cta():
        @functools.partial(
            pl.run_scoped,
            smem=plgpu.SMEM((arrive.push_stages, rows, dim), send_gmem.dtype),
            bars=plgpu.Barrier(num_arrivals=1, num_barriers=arrive.push_stages),
            collective_axes="wg",
        )
        def _scope(smem, bars):
            @pl.when(lax.axis_index("wg") == 0)
            def _push():
                push_mgpu.push_loop(
                    plan_gmem, send_gmem, recv_gmem, smem, bars, cta=cta, num_ctas=arrive.push_ctas,
                    axis_name=axis, num_peers=peers, updates_per_peer=arrive.updates_per_peer, rows=rows,
                    stages=arrive.push_stages, group_done=group_done,
                )  # fmt: skip

                @pl.when(cta == 0)
                def _all_landed():  # no peer signals this device after the kernel
                    @pl.loop(0, arrive.updates_per_peer)
                    def _(g):
                        pl.semaphore_wait(sems.at[g], peers * arrive.push_ctas, decrement=False)


def gmm_ws(
    lhs_RK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    out_dtype=None,
    config: WsConfig = WsConfig(),
    transpose_rhs: bool = False,
    push: PushSpec | None = None,
    seg_3X: jax.Array | None = None,
) -> jax.Array:
    """[R, N]: out[r] = lhs[r] @ rhs[group(r)] (rhs [E, N, K] and its transpose with `transpose_rhs`)
    for r < sum(group_sizes); the other rows are left unwritten. With `push` and the reverse plan's
    int32 [3, P * U] `seg_3X` (start here, rows, start there): [push.out_rows, N] on each device, the
    rows its peers' GEMMs sent it. Module docstring for the rest."""
    num_rows, k_dim = lhs_RK.shape
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    reason = shape_reason(lhs_RK.dtype, k_dim, n_dim, config, num_rows)
    if reason or lhs_RK.dtype != rhs_EKN.dtype:
        raise ValueError(f"gmm_ws: {reason or 'lhs and rhs dtypes differ'}")
    if push is not None and (seg_3X is None or push.out_rows % 8):
        raise ValueError(
            f"gmm_ws: a push needs seg_3X and output rows of a multiple of 8, got {push.out_rows}"
        )
    out_rows = num_rows if push is None else push.out_rows
    kernel = _launch(
        group_sizes_E, num_rows, config, transpose_rhs,
        out_type=jax.ShapeDtypeStruct((out_rows, n_dim), out_dtype or lhs_RK.dtype),
        push=push, name="xmoe_gmm_ws" if push is None else "xmoe_gmm_ws_push",
    )  # fmt: skip
    if push is None:
        return kernel(lhs_RK, rhs_EKN)
    return kernel(lhs_RK, rhs_EKN, seg_3X.astype(jnp.int32))


def _launch(
    group_sizes_E, num_rows: int, config: WsConfig, transpose_rhs: bool, *, out_type, name: str, **spec
):
    """The kernel over gmm's work list for `num_rows` grouped rows, as a function of its other operands."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    meta_4I = work_items(group_sizes_E, num_rows, config.cta_m)
    num_ctas = _num_sms()
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            config=config,
            num_items=meta_4I.shape[1],
            num_ctas=num_ctas,
            transpose_rhs=transpose_rhs,
            push=spec.pop("push", None),
            **spec,
        ),
        out_type=out_type,
        grid=(num_ctas,),
        grid_names=("cluster_grid",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name=name,
    )
    return functools.partial(kernel, meta_4I)


def arrive_gmm_ws(
    x_ND: jax.Array,
    plan_3X: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    arrive: ArriveSpec,
    out_dtype=None,
    config: WsConfig = WsConfig(),
    transpose_rhs: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(recv_MD, out_MN) on each device: the push exchange of x_ND by `plan_3X` (int32 [3, P * U]: per
    update its start here, rows and start on peer x // U, the receiving side grouped by local expert,
    as push_rows takes it) and gmm(recv_MD, rhs_EKN, group_sizes_E) in one kernel (module docstring:
    arrive prologue). M = arrive.recv_rows; rows of recv past what peers write and of out past
    sum(group_sizes) are unwritten."""
    num_rows, dim = arrive.recv_rows, x_ND.shape[1]
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    reason = shape_reason(x_ND.dtype, dim, n_dim, config, num_rows)
    if reason or x_ND.dtype != rhs_EKN.dtype:
        raise ValueError(f"arrive_gmm_ws: {reason or 'send rows and rhs dtypes differ'}")
    if (
        not 0 < arrive.push_ctas < _num_sms()
        or arrive.push_stages < 2
        or rhs_EKN.shape[0] != arrive.updates_per_peer
    ):
        raise ValueError(
            f"arrive_gmm_ws: push_ctas={arrive.push_ctas} must leave CTAs for the GEMM on {_num_sms()} SMs, "
            f"push_stages={arrive.push_stages} must be at least 2 (one loading while one writes), "
            f"and rhs's {rhs_EKN.shape[0]} groups must be the {arrive.updates_per_peer} updates per peer"
        )
    out_types = (
        jax.ShapeDtypeStruct((num_rows, dim), x_ND.dtype),
        jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype or x_ND.dtype),
    )
    kernel = _launch(
        group_sizes_E,
        num_rows,
        config,
        transpose_rhs,
        out_type=out_types,
        arrive=arrive,
        name="xmoe_arrive_gmm_ws",
    )
    return tuple(kernel(x_ND, rhs_EKN, plan_3X.astype(jnp.int32)))
