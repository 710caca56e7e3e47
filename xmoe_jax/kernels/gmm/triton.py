"""Grouped GEMMs as Triton kernels called through jax-triton (CUDA and ROCm; no CPU mode).

Legend: R rows grouped by expert, K contraction, N output columns, E experts, I work items.

The algorithm is pallas.py's, written directly in Triton so that we control what the
Pallas lowering decides for us (pointer increments instead of recomputed offsets, 64-bit row
offsets, tl.dot accumulating in place). Same work list (metadata.py), same masking,
same zero tail. `triton` and `jax_triton` are imported on first call only: the package
imports on machines without them, and backends.py falls back when they are missing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax.kernels.gmm.metadata import group_bounds, make_group_metadata


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gmm_kernel(
        item_group_ptr,
        item_tile_ptr,
        group_start_ptr,
        group_end_ptr,
        lhs_ptr,
        rhs_ptr,
        out_ptr,
        NUM_GROUPS: tl.constexpr,
        K: tl.constexpr,
        N: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
        BN: tl.constexpr,
        TRANSPOSE_RHS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        n_tiles = tl.cdiv(N, BN)
        pid = tl.program_id(0)
        item = pid // n_tiles
        col_tile = pid % n_tiles
        group = tl.load(item_group_ptr + item)
        row0 = tl.load(item_tile_ptr + item) * BM
        start = tl.load(group_start_ptr + group)
        end = tl.load(group_end_ptr + group)
        rows = row0 + tl.arange(0, BM)
        row_ok = (rows >= start) & (rows < end)
        cols = col_tile * BN + tl.arange(0, BN)
        col_ok = cols < N
        ks = tl.arange(0, BK)
        w_group = tl.minimum(group, NUM_GROUPS - 1).to(tl.int64)
        lhs_ptrs = lhs_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
        if TRANSPOSE_RHS:  # rhs [E, N, K]: load a [BK, BN] view of w[g].T
            rhs_ptrs = rhs_ptr + w_group * N * K + cols[None, :] * K + ks[:, None]
            rhs_step = BK
        else:
            rhs_ptrs = rhs_ptr + w_group * K * N + ks[:, None] * N + cols[None, :]
            rhs_step = BK * N
        num_k = tl.where(group < NUM_GROUPS, tl.cdiv(K, BK), 0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(0, num_k):
            k_ok = (kt * BK + ks) < K
            x = tl.load(lhs_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(rhs_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            lhs_ptrs += BK
            rhs_ptrs += rhs_step
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def tgmm_kernel(
        group_start_ptr,
        group_end_ptr,
        lhs_ptr,
        grad_ptr,
        out_ptr,
        K: tl.constexpr,
        N: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
        BN: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        k_tiles = tl.cdiv(K, BK)
        n_tiles = tl.cdiv(N, BN)
        pid = tl.program_id(0)
        group = pid // (k_tiles * n_tiles)
        rest = pid % (k_tiles * n_tiles)
        kk = (rest // n_tiles) * BK + tl.arange(0, BK)
        cols = (rest % n_tiles) * BN + tl.arange(0, BN)
        k_ok = kk < K
        col_ok = cols < N
        start = tl.load(group_start_ptr + group)
        end = tl.load(group_end_ptr + group)
        rows = start + tl.arange(0, BM)
        lhs_ptrs = lhs_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        grad_ptrs = grad_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for i in range(0, tl.cdiv(end - start, BM)):
            row_ok = (rows + i * BM) < end
            x = tl.load(lhs_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(grad_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(tl.trans(x), g, acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(x), g, acc)
            lhs_ptrs += BM * K
            grad_ptrs += BM * N
        out_ptrs = out_ptr + group.to(tl.int64) * K * N + kk[:, None] * N + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])

    return gmm_kernel, tgmm_kernel


def gmm_triton(
    lhs_RK,
    rhs_EKN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    transpose_rhs: bool = False,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jax.Array:
    import jax_triton as jt

    gmm_kernel, _ = _kernels()
    bm, bk, bn = tile
    num_rows, k_dim = lhs_RK.shape
    num_groups = rhs_EKN.shape[0]
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    meta = make_group_metadata(group_sizes_E, num_rows, bm)
    grid = meta.item_group_I.shape[0] * -(-n_dim // bn)
    return jt.triton_call(
        *meta,
        lhs_RK,
        rhs_EKN,
        kernel=gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
        grid=(grid,),
        num_warps=num_warps,
        num_stages=num_stages,
        NUM_GROUPS=num_groups,
        K=k_dim,
        N=n_dim,
        BM=bm,
        BK=bk,
        BN=bn,
        TRANSPOSE_RHS=transpose_rhs,
        IEEE=jnp.dtype(lhs_RK.dtype) == jnp.dtype(jnp.float32),
    )


def tgmm_triton(
    lhs_RK,
    grad_RN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jax.Array:
    import jax_triton as jt

    _, tgmm_kernel = _kernels()
    bm, bk, bn = tile
    num_rows, k_dim = lhs_RK.shape
    n_dim = grad_RN.shape[1]
    num_groups = group_sizes_E.shape[0]
    starts_E, ends_E = group_bounds(group_sizes_E, num_rows)
    grid = num_groups * -(-k_dim // bk) * -(-n_dim // bn)
    return jt.triton_call(
        starts_E,
        ends_E,
        lhs_RK,
        grad_RN,
        kernel=tgmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k_dim, n_dim), out_dtype),
        grid=(grid,),
        num_warps=num_warps,
        num_stages=num_stages,
        K=k_dim,
        N=n_dim,
        BM=bm,
        BK=bk,
        BN=bn,
        IEEE=jnp.dtype(lhs_RK.dtype) == jnp.dtype(jnp.float32),
    )
