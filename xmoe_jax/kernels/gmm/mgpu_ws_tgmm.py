"""The weight gradient of the grouped GEMM on Hopper: our warp-specialized Mosaic-GPU tgmm.

Legend: R grouped rows, M lhs columns, N grad columns, E experts (groups), T = 2 compute warpgroups.

    out_EMN = tgmm_ws(lhs_RM, grad_RN, group_sizes_E, out_dtype=..., config=WsConfig(...))
    # out[e] = lhs[rows of e].T @ grad[rows of e]; zeros for an empty group

Why: in the one-GPU train step the Pallas tgmm takes 4.2 ms a call where `ws` (gmm/mgpu_ws.py) takes
3.4 ms for a GEMM of the same FLOPs (benchmarks/train_step.md, 2026-11-29), and JAX's bundled Mosaic
`transposed_ragged_dot` (one warpgroup, no producer) runs 51-70% of a dense matmul (defaults.py).

Structure: gmm_ws's (a persistent grid of one CTA per SM, a memory warpgroup streaming tiles by TMA
through a ring of shared-memory stages, two compute warpgroups each accumulating half the CTA tile
with wgmma), over work items (group, M tile, N tile), group-major with a planar snake over the tiles.
The contraction runs over the group's rows: a pipeline with a dynamic grid of the group's row blocks,
the first starting at the group's start rounded down to tile_k (as JAX's `transposed_ragged_dot`).
The first and last blocks hold rows of the neighbouring groups: each compute warpgroup zeroes those
rows of the operand half it alone reads (lhs columns when the CTA tile is split along M, grad columns
when split along N) before its wgmma. Rows past R are TMA's zero fill. An empty group stores its zero
accumulator. Needs: equal 16-bit inputs, M % cta_m == 0, N % cta_n == 0, R % 8 == 0, and no wgmma left
in flight (`in_flight=0`): with one in flight (the stage released a step late, as gmm_ws runs) the
pipeline's dynamic grid faulted on an H200 (CUDA_ERROR_LAUNCH_FAILED, jax 0.11.2); with none it is exact.

Measured on one H200 (benchmarks/kernels.md, 2026-11-29): split along M (CTA 256 x 128) runs the
up-projection's dW ([2048, 1408]) at 658 TFLOP/s, 1.20x the Pallas tgmm (1.15x at EP 4's rows); split along
N (128 x 256) ran the down-projection's ([1408, 2048]) at 0.88-0.96x Pallas, so defaults.WS_TGMM_CONFIGS
holds the M split only and that shape stays on Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax.kernels.gmm.mgpu_ws import WsConfig, _num_sms


def shape_reason(
    dtype, m_dim: int, n_dim: int, num_rows: int, config: WsConfig, out_dtype=None
) -> str | None:
    """Why the kernel cannot take this call, or None (out_dtype None: the inputs')."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bfloat16/float16 inputs, got {jnp.dtype(dtype)}"
    if out_dtype is not None and jnp.dtype(out_dtype).itemsize != 2:  # its output tiles beside 4 stages
        return f"it stores 16-bit gradients, not {jnp.dtype(out_dtype)} (they would not fit shared memory)"
    if num_rows % 8 or num_rows < config.tile_k:
        return f"{num_rows} rows: needs a multiple of 8 and at least tile_k={config.tile_k}"
    if m_dim % config.cta_m or n_dim % config.cta_n:
        return f"[{m_dim}, {n_dim}] outputs are not whole {config.cta_m} x {config.cta_n} CTA tiles"
    epi_n = config.epi_n or config.tile_n
    if config.tile_n % epi_n or epi_n * 2 % 128:
        return f"epi_n={epi_n} must divide tile_n={config.tile_n} in rows of a multiple of 128 bytes"
    if config.in_flight:
        return (
            f"in_flight={config.in_flight}: a wgmma left in flight faulted with the dynamic grid (docstring)"
        )
    return None


def group_blocks(group_sizes_E: jax.Array, tile_k: int) -> jax.Array:
    """int32 [4, E]: per group the first row of its first block (its start rounded down to tile_k), its
    blocks, the rows of the first block before the group, and the last row of the group in its last block."""
    sizes = group_sizes_E.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile_k * tile_k
    blocks = jnp.where(sizes > 0, (ends - first + tile_k - 1) // tile_k, 0)
    last = ends - 1 - (first + (blocks - 1) * tile_k)
    return jnp.stack([first, blocks, starts - first, last]).astype(jnp.int32)


def _kernel(meta_gmem, lhs_gmem, grad_gmem, out_gmem, *, config: WsConfig, num_groups: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
    num_rows, m_dim = lhs_gmem.shape
    n_dim = grad_gmem.shape[1]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_m, cta_n = config.cta_m, config.cta_n
    m_iters, n_iters = m_dim // cta_m, n_dim // cta_n
    itemsize = jnp.dtype(dtype).itemsize
    # the blocks are [tile_k rows, columns]: swizzled along the columns (each warpgroup's half whole)
    swizzle = plgpu.find_swizzle(min(tile_m, tile_n) * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    epi_n = config.epi_n or tile_n
    split_m = config.split == "m"

    def get_pipeline(body, compute_context, num_blocks):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_blocks,),
            memory_registers=40,
            in_specs=[  # lhs [tile_k, cta_m] and grad [tile_k, cta_n] blocks, row block k of the group
                plgpu.BlockSpec(
                    (tile_k, cols),
                    lambda k: (k, 0),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=config.in_flight,
                )
                for cols in (cta_m, cta_n)
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731  the functions do not change the allocations

    def tiles(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_groups * m_iters * n_iters,), collective_axes="cluster_grid")
        def _tile_loop(info):
            lin = info.index[0]
            group = lin // (m_iters * n_iters)
            m_idx, n_idx = plgpu.planar_snake(
                lin % (m_iters * n_iters), (m_iters, n_iters), 1, config.snake_width
            )
            first_row = pl.multiple_of(meta_gmem[0, group], tile_k)
            num_blocks = meta_gmem[1, group]
            head, last = meta_gmem[2, group], meta_gmem[3, group]
            if split_m:
                wg_row0, wg_col0 = m_idx * cta_m + wg * tile_m, n_idx * cta_n
            else:
                wg_row0, wg_col0 = m_idx * cta_m, n_idx * cta_n + wg * tile_n

            def store(acc):  # [tile_m, tile_n] float32 -> out[group] at this warpgroup's tile
                for col in range(0, tile_n, epi_n):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read out_smem
                    out_smem[wg] = acc[:, col : col + epi_n].astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg],
                        out_gmem.at[group, pl.ds(wg_row0, tile_m), pl.ds(wg_col0 + col, epi_n)],
                    )

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    store(acc_ref[...])

            def zero_rows(ref, keep):  # rows r of this warpgroup's operand half where not keep(r): zeros
                rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
                ref[...] = ref[...] * keep(rows).astype(ref.dtype)
                plgpu.commit_smem()

            def mma_body(idx, lhs_smem, grad_smem, acc_ref):
                k = idx[0]
                if split_m:
                    lhs_tile, grad_tile = lhs_smem.at[:, pl.ds(wg * tile_m, tile_m)], grad_smem
                    own = lhs_tile
                else:
                    lhs_tile, grad_tile = lhs_smem, grad_smem.at[:, pl.ds(wg * tile_n, tile_n)]
                    own = grad_tile

                @pl.when(k == 0)
                def _head():  # rows of the group before it in the first block
                    zero_rows(own, lambda r: r >= head)

                @pl.when(k == num_blocks - 1)
                def _tail():  # rows of the group after it in the last block
                    zero_rows(own, lambda r: r <= last)

                # a transposed view (ref.transpose: jax 0.12.1 removed plgpu.transpose_ref)
                plgpu.wgmma(acc_ref, lhs_tile.transpose((1, 0)), grad_tile)
                plgpu.wgmma_wait(config.in_flight)
                return acc_ref

            rows = pl.ds(first_row, num_rows)  # past R: never read past the group's blocks (TMA fills zeros)

            @pl.when(num_blocks > 0)
            def _group():
                get_pipeline(mma_body, compute_context, num_blocks)(
                    lhs_gmem.at[rows, pl.ds(m_idx * cta_m, cta_m)],
                    grad_gmem.at[rows, pl.ds(n_idx * cta_n, cta_n)],
                    allocations=pipeline_allocs,
                )

            @pl.when((num_blocks == 0) & (wg < 2))
            def _empty():  # an empty group's gradient is zeros
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    store(acc_ref[...])

    scope = functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore, config.stages).get_allocations(
            lhs_gmem.at[:, :cta_m], grad_gmem.at[:, :cta_n]
        ),
        out_smem=plgpu.SMEM((2, tile_m, epi_n), out_dtype),
        collective_axes="wg",
    )
    scope(tiles)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tgmm_ws(
    lhs_RM: jax.Array,
    grad_RN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    out_dtype=None,
    config: WsConfig,
) -> jax.Array:
    """[E, M, N]: out[e] = lhs[rows of e].T @ grad[rows of e] (float32 accumulation, rows past
    sum(group_sizes) ignored, zeros for an empty group). Module docstring for the rest."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    num_rows, m_dim = lhs_RM.shape
    n_dim = grad_RN.shape[1]
    reason = shape_reason(lhs_RM.dtype, m_dim, n_dim, num_rows, config, out_dtype)
    if reason or lhs_RM.dtype != grad_RN.dtype or grad_RN.shape[0] != num_rows:
        raise ValueError(f"tgmm_ws: {reason or 'lhs and grad must have the same dtype and rows'}")
    num_groups = group_sizes_E.shape[0]
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, num_groups=num_groups),
        out_type=jax.ShapeDtypeStruct((num_groups, m_dim, n_dim), out_dtype or lhs_RM.dtype),
        grid=(_num_sms(),),
        grid_names=("cluster_grid",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name="xmoe_tgmm_ws",
    )
    return kernel(group_blocks(group_sizes_E, config.tile_k), lhs_RM, grad_RN)
