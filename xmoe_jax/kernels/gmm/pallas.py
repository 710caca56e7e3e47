"""Grouped GEMMs as Triton-style Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

Legend: R grouped rows (grouped by expert), L lhs rows, O output rows, K contraction, N output
columns, E experts (groups), I work items (see metadata.py); bm/bk/bn the tile.

Why Triton-style (plain pointer arithmetic over whole-array refs, masked loads and stores)
rather than BlockSpecs: groups start at arbitrary rows, so a program's rows are not a block
of a fixed grid; K or N need not be multiples of the tile; and rows may be gathered and
scattered through index arrays (schedule.py). Every load is masked to the group's rows and to
the array's columns, every store to the rows the program owns. The same kernel lowers through
Pallas' Triton backend on NVIDIA and ROCm (power-of-2 tiles) and runs in `interpret=True` mode
on CPU, which is how CI tests its logic.

Weights are passed flattened ([E*K, N], or [E*N, K] for the transposed product) so a
program addresses its group's slice with one row offset instead of a dynamic leading index.

gmm:  schedule.py's grid (one program per (work item, N tile), N tiles fastest so consecutive
      programs reuse one lhs row tile from L2, then the optional fill programs). Program (i, j)
      computes rows tile_i of group g_i (loaded at lhs_rows[r] when gathered) times
      rhs[g_i][:, j-th column tile] with a float32 accumulator over K, and stores them (at
      out_rows[r] when scattered). Rows past sum(group_sizes) are not read, computed or stored.
tgmm: grid = E * cdiv(K, bk) * cdiv(N, bn). Program (e, p, q) walks group e's rows in chunks
      of bm and accumulates lhs[chunk, p].T @ grad[chunk, q] (each loaded through its index
      when gathered); empty groups store zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xmoe_jax.kernels.gmm import schedule
from xmoe_jax.kernels.gmm.metadata import group_bounds

_NN = (((1,), (0,)), ((), ()))  # x[m,k] @ w[k,n]
_NT = (((1,), (1,)), ((), ()))  # x[m,k] @ w[n,k].T
_TN = (((0,), (0,)), ((), ()))  # x[m,k].T @ g[m,n]


def _compiler_params(num_warps: int | None, num_stages: int | None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(x, w, dims):
    # float32 inputs: full IEEE products (the Triton lowering's default would be TF32)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)


def _gmm_body(tile, operand_refs, *, k_dim, n_dim, bm, bk, bn, transpose_rhs):
    """The bf16/f32 K loop of one GEMM program (schedule.py owns the rows, columns and store)."""
    lhs_ref, rhs_ref = operand_refs

    def step(kt, acc):
        k0 = pl.multiple_of(kt * bk, bk)
        k_ok = (k0 + jnp.arange(bk)) < k_dim
        x = schedule.load_rows(lhs_ref, tile, k0, bk, bm, limit=k_dim)
        if transpose_rhs:
            w = plgpu.load(
                rhs_ref.at[pl.ds(tile.w_group * n_dim + tile.col0, bn), pl.ds(k0, bk)],
                mask=tile.col_ok[:, None] & k_ok[None, :],
                other=0,
            )
            return acc + _dot(x, w, _NT)
        w = plgpu.load(
            rhs_ref.at[pl.ds(tile.w_group * k_dim + k0, bk), pl.ds(tile.col0, bn)],
            mask=k_ok[:, None] & tile.col_ok[None, :],
            other=0,
        )
        return acc + _dot(x, w, _NN)

    return lax.fori_loop(0, tile.num_k, step, jnp.zeros((bm, bn), jnp.float32))


def gmm_pallas(
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
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """[O, N] grouped product (api.py's gmm); rhs is [E, K, N] ([E, N, K] with transpose_rhs)."""
    bm, bk, bn = tile
    num_lhs_rows, k_dim = lhs_LK.shape
    num_groups = rhs_EKN.shape[0]
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    rows, lead = schedule.plan(
        group_sizes_E, num_lhs_rows, bm, lhs_rows_R, out_rows_R, num_out_rows, zero_unwritten
    )
    body = functools.partial(
        _gmm_body, k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk, bn=bn, transpose_rhs=transpose_rhs
    )
    kernel = functools.partial(
        schedule.run_gmm, body=body, rows=rows, num_groups=num_groups, k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk,
        bn=bn, interpret=interpret,
    )  # fmt: skip
    rhs_2d = rhs_EKN.reshape(-1, rhs_EKN.shape[2])
    return pl.pallas_call(
        lambda *refs: kernel(refs),
        out_shape=jax.ShapeDtypeStruct((rows.num_out_rows, n_dim), out_dtype),
        grid=(schedule.num_programs(lead[0].shape[0], rows, n_dim, bm, bn),),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="xmoe_gmm",
    )(*lead, lhs_LK, rhs_2d)


def _load_chunk(ref, rows_ref, row0, row_ok, c0, width, limit, num_ref_rows, bm):
    """[bm, width] of ref at grouped rows row0.. (through rows_ref when gathered), columns c0.."""
    cols = c0 + jnp.arange(width)
    mask = row_ok[:, None] & (cols < limit)[None, :]
    if rows_ref is None:
        return plgpu.load(ref.at[pl.ds(row0, bm), pl.ds(c0, width)], mask=mask, other=0)
    src = plgpu.load(rows_ref.at[pl.ds(row0, bm)], mask=row_ok, other=-1)
    ok = row_ok & (src >= 0) & (src < num_ref_rows)
    view = ref.at[jnp.where(ok, src, 0)[:, None], cols[None, :]]
    return plgpu.load(view, mask=ok[:, None] & (cols < limit)[None, :], other=0)


def _tgmm_kernel(*refs, gather_lhs, gather_grad, num_lhs_rows, num_grad_rows, k_dim, n_dim, bm, bk, bn):
    group_start_ref, group_end_ref, *rest = refs
    lhs_rows_ref = rest.pop(0) if gather_lhs else None
    grad_rows_ref = rest.pop(0) if gather_grad else None
    lhs_ref, grad_ref, out_ref = rest
    k_tiles, n_tiles = pl.cdiv(k_dim, bk), pl.cdiv(n_dim, bn)
    pid = pl.program_id(0)
    group, rest_pid = pid // (k_tiles * n_tiles), pid % (k_tiles * n_tiles)
    k0 = pl.multiple_of((rest_pid // n_tiles) * bk, bk)
    col0 = pl.multiple_of((rest_pid % n_tiles) * bn, bn)
    k_ok = (k0 + jnp.arange(bk)) < k_dim
    col_ok = (col0 + jnp.arange(bn)) < n_dim
    start, end = group_start_ref[group], group_end_ref[group]

    def body(i, acc):
        row0 = start + i * bm
        row_ok = (row0 + jnp.arange(bm)) < end
        x = _load_chunk(lhs_ref, lhs_rows_ref, row0, row_ok, k0, bk, k_dim, num_lhs_rows, bm)
        g = _load_chunk(grad_ref, grad_rows_ref, row0, row_ok, col0, bn, n_dim, num_grad_rows, bm)
        return acc + _dot(x, g, _TN)

    acc = lax.fori_loop(0, pl.cdiv(end - start, bm), body, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(group * k_dim + k0, bk), pl.ds(col0, bn)],
        acc.astype(out_ref.dtype),
        mask=k_ok[:, None] & col_ok[None, :],
    )


def tgmm_pallas(
    lhs_LK,
    grad_GN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    lhs_rows_R=None,
    grad_rows_R=None,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """[E, K, N]: per group lhs[rows].T @ grad[rows] (api.py's tgmm; rows through the indices)."""
    bm, bk, bn = tile
    k_dim, n_dim = lhs_LK.shape[1], grad_GN.shape[1]
    num_rows = next((a.shape[0] for a in (lhs_rows_R, grad_rows_R) if a is not None), lhs_LK.shape[0])
    num_groups = group_sizes_E.shape[0]
    starts_E, ends_E = group_bounds(group_sizes_E, num_rows)
    num_programs = num_groups * pl.cdiv(k_dim, bk) * pl.cdiv(n_dim, bn)
    kernel = functools.partial(
        _tgmm_kernel, gather_lhs=lhs_rows_R is not None, gather_grad=grad_rows_R is not None,
        num_lhs_rows=lhs_LK.shape[0], num_grad_rows=grad_GN.shape[0], k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk,
        bn=bn,
    )  # fmt: skip
    index = tuple(a for a in (lhs_rows_R, grad_rows_R) if a is not None)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups * k_dim, n_dim), out_dtype),
        grid=(num_programs,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="xmoe_tgmm",
    )(starts_E, ends_E, *index, lhs_LK, grad_GN)
    return out.reshape(num_groups, k_dim, n_dim)
