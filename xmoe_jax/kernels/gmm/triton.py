"""Grouped GEMMs as Triton kernels called through jax-triton (CUDA and ROCm; no CPU mode).

Legend: R grouped rows, L lhs rows, O output rows, K contraction, N output columns, E experts,
I work items.

The algorithm is pallas.py's (schedule.py: work list, masks, row indices, fill programs),
written directly in Triton so that we control what the Pallas lowering decides for us (pointer
increments instead of recomputed offsets, 64-bit row offsets, tl.dot accumulating in place).
Gathered rows load their indices once per tile and then step their pointers along K like the
contiguous ones. Untested on this project's CPU CI (no Triton there); the GPU suite in
tests/test_kernels.py runs it. `triton` and `jax_triton` are imported on first call only: the package
imports on machines without them, and backends.py falls back when they are missing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax.kernels.gmm import schedule
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
        lhs_rows_ptr,
        out_rows_ptr,
        written_ptr,
        lhs_ptr,
        rhs_ptr,
        out_ptr,
        NUM_GROUPS: tl.constexpr,
        NUM_ITEMS: tl.constexpr,
        K: tl.constexpr,
        N: tl.constexpr,
        NUM_LHS_ROWS: tl.constexpr,
        NUM_OUT_ROWS: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
        BN: tl.constexpr,
        TRANSPOSE_RHS: tl.constexpr,
        GATHER: tl.constexpr,
        SCATTER: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        n_tiles = tl.cdiv(N, BN)
        pid = tl.program_id(0)
        if pid >= NUM_ITEMS * n_tiles:  # a fill program (there are none without zero_unwritten)
            q = pid - NUM_ITEMS * n_tiles
            rows = (q // n_tiles) * BM + tl.arange(0, BM)
            cols = (q % n_tiles) * BN + tl.arange(0, BN)
            row_ok = rows < NUM_OUT_ROWS
            empty = tl.load(written_ptr + rows, mask=row_ok, other=1) == 0
            out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
            zeros = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptrs, zeros, mask=(empty & row_ok)[:, None] & (cols < N)[None, :])
        else:
            item = pid // n_tiles
            col_tile = pid % n_tiles
            group = tl.load(item_group_ptr + item)
            row0 = tl.load(item_tile_ptr + item) * BM
            start = tl.load(group_start_ptr + group)
            end = tl.load(group_end_ptr + group)
            rows = row0 + tl.arange(0, BM)
            row_ok = (rows >= start) & (rows < end)
            if GATHER:  # lhs rows through the index (vLLM's offs_token // top_k load)
                src = tl.load(lhs_rows_ptr + rows, mask=row_ok, other=-1)
                src_ok = row_ok & (src >= 0) & (src < NUM_LHS_ROWS)
                src = tl.where(src_ok, src, 0)
            else:
                src = rows
                src_ok = row_ok
            cols = col_tile * BN + tl.arange(0, BN)
            col_ok = cols < N
            ks = tl.arange(0, BK)
            w_group = tl.minimum(group, NUM_GROUPS - 1).to(tl.int64)
            lhs_ptrs = lhs_ptr + src[:, None].to(tl.int64) * K + ks[None, :]
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
                x = tl.load(lhs_ptrs, mask=src_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(rhs_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w, acc)
                lhs_ptrs += BK
                rhs_ptrs += rhs_step
            if SCATTER:  # output rows through the index
                dst = tl.load(out_rows_ptr + rows, mask=row_ok, other=-1)
                dst_ok = row_ok & (dst >= 0) & (dst < NUM_OUT_ROWS)
                dst = tl.where(dst_ok, dst, 0)
            else:
                dst = rows
                dst_ok = row_ok
            out_ptrs = out_ptr + dst[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=dst_ok[:, None] & col_ok[None, :])

    @triton.jit
    def tgmm_kernel(
        group_start_ptr,
        group_end_ptr,
        lhs_rows_ptr,
        grad_rows_ptr,
        lhs_ptr,
        grad_ptr,
        out_ptr,
        K: tl.constexpr,
        N: tl.constexpr,
        NUM_LHS_ROWS: tl.constexpr,
        NUM_GRAD_ROWS: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
        BN: tl.constexpr,
        GATHER_LHS: tl.constexpr,
        GATHER_GRAD: tl.constexpr,
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
            chunk = rows + i * BM
            row_ok = chunk < end
            if GATHER_LHS:
                a = tl.load(lhs_rows_ptr + chunk, mask=row_ok, other=-1)
                a_ok = row_ok & (a >= 0) & (a < NUM_LHS_ROWS)
                a_ptrs = lhs_ptr + tl.where(a_ok, a, 0)[:, None].to(tl.int64) * K + kk[None, :]
                x = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                x = tl.load(lhs_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if GATHER_GRAD:
                b = tl.load(grad_rows_ptr + chunk, mask=row_ok, other=-1)
                b_ok = row_ok & (b >= 0) & (b < NUM_GRAD_ROWS)
                b_ptrs = grad_ptr + tl.where(b_ok, b, 0)[:, None].to(tl.int64) * N + cols[None, :]
                g = tl.load(b_ptrs, mask=b_ok[:, None] & col_ok[None, :], other=0.0)
            else:
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


def _index_or_dummy(rows_R):
    """jax-triton passes every pointer: an absent index is a 1-element placeholder never read."""
    return jnp.zeros((1,), jnp.int32) if rows_R is None else rows_R


def gmm_triton(
    lhs_LK,
    rhs_EKN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    transpose_rhs: bool = False,
    lhs_rows_R=None,
    out_rows_R=None,
    num_out_rows: int | None = None,
    zero_unwritten: bool = False,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jax.Array:
    import jax_triton as jt

    gmm_kernel, _ = _kernels()
    bm, bk, bn = tile
    num_lhs_rows, k_dim = lhs_LK.shape
    num_groups = rhs_EKN.shape[0]
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    num_rows = num_lhs_rows if lhs_rows_R is None else lhs_rows_R.shape[0]
    num_out = num_rows if out_rows_R is None else int(num_out_rows)
    meta = make_group_metadata(group_sizes_E, num_rows, bm)
    written_O = (
        schedule.written_rows(group_sizes_E, num_rows, out_rows_R, num_out) if zero_unwritten else None
    )
    num_items = meta.item_group_I.shape[0]
    n_tiles = -(-n_dim // bn)
    fill = -(-num_out // bm) * n_tiles if zero_unwritten else 0
    return jt.triton_call(
        *meta,
        _index_or_dummy(lhs_rows_R),
        _index_or_dummy(out_rows_R),
        _index_or_dummy(written_O),
        lhs_LK,
        rhs_EKN,
        kernel=gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_out, n_dim), out_dtype),
        grid=(num_items * n_tiles + fill,),
        num_warps=num_warps,
        num_stages=num_stages,
        NUM_GROUPS=num_groups,
        NUM_ITEMS=num_items,
        K=k_dim,
        N=n_dim,
        NUM_LHS_ROWS=num_lhs_rows,
        NUM_OUT_ROWS=num_out,
        BM=bm,
        BK=bk,
        BN=bn,
        TRANSPOSE_RHS=transpose_rhs,
        GATHER=lhs_rows_R is not None,
        SCATTER=out_rows_R is not None,
        IEEE=jnp.dtype(lhs_LK.dtype) == jnp.dtype(jnp.float32),
    )


def tgmm_triton(
    lhs_LK,
    grad_GN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    lhs_rows_R=None,
    grad_rows_R=None,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jax.Array:
    import jax_triton as jt

    _, tgmm_kernel = _kernels()
    bm, bk, bn = tile
    k_dim, n_dim = lhs_LK.shape[1], grad_GN.shape[1]
    num_rows = next((a.shape[0] for a in (lhs_rows_R, grad_rows_R) if a is not None), lhs_LK.shape[0])
    num_groups = group_sizes_E.shape[0]
    starts_E, ends_E = group_bounds(group_sizes_E, num_rows)
    grid = num_groups * -(-k_dim // bk) * -(-n_dim // bn)
    return jt.triton_call(
        starts_E,
        ends_E,
        _index_or_dummy(lhs_rows_R),
        _index_or_dummy(grad_rows_R),
        lhs_LK,
        grad_GN,
        kernel=tgmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k_dim, n_dim), out_dtype),
        grid=(grid,),
        num_warps=num_warps,
        num_stages=num_stages,
        K=k_dim,
        N=n_dim,
        NUM_LHS_ROWS=lhs_LK.shape[0],
        NUM_GRAD_ROWS=grad_GN.shape[0],
        BM=bm,
        BK=bk,
        BN=bn,
        GATHER_LHS=lhs_rows_R is not None,
        GATHER_GRAD=grad_rows_R is not None,
        IEEE=jnp.dtype(lhs_LK.dtype) == jnp.dtype(jnp.float32),
    )
