"""Grouped GEMMs as Triton-style Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

Legend: R rows grouped by expert, K contraction, N output columns, E experts (groups),
I work items (see metadata.py); bm/bk/bn the tile (block_m, block_k, block_n).

Why Triton-style (plain pointer arithmetic over whole-array refs, masked loads and stores)
rather than BlockSpecs: groups start at arbitrary rows, so a program's rows are not a block
of a fixed grid; and K or N need not be multiples of the tile. Every load is masked to the
group's rows and to the array's columns, every store to the rows the program owns. The same
kernel lowers through Pallas' Triton backend on NVIDIA and ROCm (power-of-2 tiles) and runs
in `interpret=True` mode on CPU, which is how CI tests its logic.

Weights are passed flattened ([E*K, N], or [E*N, K] for the transposed product) so a
program addresses its group's slice with one row offset instead of a dynamic leading index.

gmm:  grid = I * cdiv(N, bn) programs, N tiles fastest so consecutive programs reuse one
      lhs row tile from L2. Program (i, j) computes rows tile_i of group g_i times
      rhs[g_i][:, j-th column tile] with a float32 accumulator over K.
tgmm: grid = E * cdiv(K, bk) * cdiv(N, bn). Program (e, p, q) walks group e's rows in chunks
      of bm and accumulates lhs[chunk, p].T @ grad[chunk, q]; empty groups store zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xmoe_jax.kernels.gmm.metadata import group_bounds, make_group_metadata

_NN = (((1,), (0,)), ((), ()))  # x[m,k] @ w[k,n]
_NT = (((1,), (1,)), ((), ()))  # x[m,k] @ w[n,k].T
_TN = (((0,), (0,)), ((), ()))  # x[m,k].T @ g[m,n]


def _compiler_params(num_warps: int | None, num_stages: int | None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(x, w, dims):
    # float32 inputs: full IEEE products (the Triton lowering's default would be TF32)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)


def _gmm_kernel(
    item_group_ref,
    item_tile_ref,
    group_start_ref,
    group_end_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    num_groups,
    k_dim,
    n_dim,
    bm,
    bk,
    bn,
    transpose_rhs,
):
    n_tiles = pl.cdiv(n_dim, bn)
    pid = pl.program_id(0)
    item, col_tile = pid // n_tiles, pid % n_tiles
    group = item_group_ref[item]
    row0 = pl.multiple_of(item_tile_ref[item] * bm, bm)
    col0 = pl.multiple_of(col_tile * bn, bn)
    rows = row0 + jnp.arange(bm)
    row_ok = (rows >= group_start_ref[group]) & (rows < group_end_ref[group])
    cols = col0 + jnp.arange(bn)
    col_ok = cols < n_dim
    w_group = jnp.minimum(group, num_groups - 1)  # tail/idle items read group E-1 but never use it

    def body(kt, acc):
        k0 = pl.multiple_of(kt * bk, bk)
        k_ok = (k0 + jnp.arange(bk)) < k_dim
        x = plgpu.load(
            lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0
        )
        if transpose_rhs:
            w = plgpu.load(
                rhs_ref.at[pl.ds(w_group * n_dim + col0, bn), pl.ds(k0, bk)],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0,
            )
            return acc + _dot(x, w, _NT)
        w = plgpu.load(
            rhs_ref.at[pl.ds(w_group * k_dim + k0, bk), pl.ds(col0, bn)],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0,
        )
        return acc + _dot(x, w, _NN)

    # the zero tail (group E) and idle items skip the K loop
    num_k = (group < num_groups).astype(jnp.int32) * pl.cdiv(k_dim, bk)
    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)],
        acc.astype(out_ref.dtype),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def gmm_pallas(
    lhs_RK,
    rhs_EKN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    transpose_rhs: bool = False,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """[R, N] grouped product; rhs is [E, K, N] ([E, N, K] with transpose_rhs)."""
    bm, bk, bn = tile
    num_rows, k_dim = lhs_RK.shape
    num_groups = rhs_EKN.shape[0]
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    meta = make_group_metadata(group_sizes_E, num_rows, bm)
    num_programs = meta.item_group_I.shape[0] * pl.cdiv(n_dim, bn)
    kernel = functools.partial(
        _gmm_kernel,
        num_groups=num_groups,
        k_dim=k_dim,
        n_dim=n_dim,
        bm=bm,
        bk=bk,
        bn=bn,
        transpose_rhs=transpose_rhs,
    )
    rhs_2d = rhs_EKN.reshape(-1, rhs_EKN.shape[2])
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
        grid=(num_programs,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="xmoe_gmm",
    )(*meta, lhs_RK, rhs_2d)


def _tgmm_kernel(
    group_start_ref,
    group_end_ref,
    lhs_ref,
    grad_ref,
    out_ref,
    *,
    k_dim,
    n_dim,
    bm,
    bk,
    bn,
):
    k_tiles, n_tiles = pl.cdiv(k_dim, bk), pl.cdiv(n_dim, bn)
    pid = pl.program_id(0)
    group, rest = pid // (k_tiles * n_tiles), pid % (k_tiles * n_tiles)
    k0 = pl.multiple_of((rest // n_tiles) * bk, bk)
    col0 = pl.multiple_of((rest % n_tiles) * bn, bn)
    k_ok = (k0 + jnp.arange(bk)) < k_dim
    col_ok = (col0 + jnp.arange(bn)) < n_dim
    start, end = group_start_ref[group], group_end_ref[group]

    def body(i, acc):
        row0 = start + i * bm
        row_ok = (row0 + jnp.arange(bm)) < end
        x = plgpu.load(
            lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0
        )
        g = plgpu.load(
            grad_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], mask=row_ok[:, None] & col_ok[None, :], other=0
        )
        return acc + _dot(x, g, _TN)

    acc = lax.fori_loop(0, pl.cdiv(end - start, bm), body, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(group * k_dim + k0, bk), pl.ds(col0, bn)],
        acc.astype(out_ref.dtype),
        mask=k_ok[:, None] & col_ok[None, :],
    )


def tgmm_pallas(
    lhs_RK,
    grad_RN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """[E, K, N]: per group lhs[rows].T @ grad[rows] (the weight gradient of gmm)."""
    bm, bk, bn = tile
    num_rows, k_dim = lhs_RK.shape
    n_dim = grad_RN.shape[1]
    num_groups = group_sizes_E.shape[0]
    starts_E, ends_E = group_bounds(group_sizes_E, num_rows)
    num_programs = num_groups * pl.cdiv(k_dim, bk) * pl.cdiv(n_dim, bn)
    kernel = functools.partial(_tgmm_kernel, k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk, bn=bn)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups * k_dim, n_dim), out_dtype),
        grid=(num_programs,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="xmoe_tgmm",
    )(starts_E, ends_E, lhs_RK, grad_RN)
    return out.reshape(num_groups, k_dim, n_dim)
