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
Fused activation (gmm/fused.py): with `lhs_activation` the lhs is the experts' concatenated hidden
      [R, n*F] and each K step loads its gate and up tiles and applies the activation before the dot
      (a prologue: no [R, F] activation array exists); with `act_grad=(activation, hidden)` the
      K loop's [bm, bn] result is d act and the store (an epilogue) writes d gate and d up of that
      hidden's rows into an [R, n*F] output. tgmm's `lhs_activation` reads its lhs chunks the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xmoe_jax.kernels.gmm import schedule
from xmoe_jax.kernels.gmm.activation import act_f32, act_grad_f32, num_matrices
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


def _plain_lhs(lhs_ref, tile, k0, *, bk, bm, k_dim):
    return schedule.load_rows(lhs_ref, tile, k0, bk, bm, limit=k_dim)


def _act_tile(load, k0, k_dim, activation, dtype):
    """act(hidden) at columns k0.. of F = k_dim, from `load(c0, limit)`: gate at k0, up at (n-1)F + k0."""
    n = num_matrices(activation)
    up = load(c0=(n - 1) * k_dim + k0, limit=n * k_dim)
    gate = load(c0=k0, limit=k_dim) if n == 2 else None
    return act_f32(gate, up, activation).astype(dtype)


def _act_lhs(hidden_ref, tile, k0, *, bk, bm, k_dim, activation):
    """act(hidden) at the tile's lhs rows (the gmm prologue)."""

    def load(c0, limit):
        return schedule.load_rows(hidden_ref, tile, c0, bk, bm, limit=limit)

    return _act_tile(load, k0, k_dim, activation, hidden_ref.dtype)


def _gmm_body(tile, operand_refs, *, k_dim, n_dim, bm, bk, bn, transpose_rhs, load_lhs):
    """The bf16/f32 K loop of one GEMM program (schedule.py owns the rows, columns and store)."""
    lhs_ref, rhs_ref = operand_refs[:2]

    def step(kt, acc):
        k0 = pl.multiple_of(kt * bk, bk)
        k_ok = (k0 + jnp.arange(bk)) < k_dim
        x = load_lhs(lhs_ref, tile, k0, bk=bk, bm=bm, k_dim=k_dim)
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


def _store_act_grad(out_ref, tile, acc, operand_refs, *, bm, bn, f_dim, activation):
    """The epilogue of d hidden = act'(hidden) * d act: the tile's grouped rows of hidden (the last
    operand) at columns col0.. of gate and up, and d gate / d up stored at the same columns."""
    hidden_ref = operand_refs[-1]
    n = num_matrices(activation)
    rows = pl.ds(tile.row0, bm)
    mask = tile.row_ok[:, None] & tile.col_ok[None, :]
    up_cols = pl.ds((n - 1) * f_dim + tile.col0, bn)
    up = plgpu.load(hidden_ref.at[rows, up_cols], mask=mask, other=0)
    gate = plgpu.load(hidden_ref.at[rows, pl.ds(tile.col0, bn)], mask=mask, other=0) if n == 2 else None
    d_gate, d_up = act_grad_f32(gate, up, acc, activation)
    plgpu.store(out_ref.at[rows, up_cols], d_up.astype(out_ref.dtype), mask=mask)
    if d_gate is not None:
        plgpu.store(out_ref.at[rows, pl.ds(tile.col0, bn)], d_gate.astype(out_ref.dtype), mask=mask)


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
    lhs_activation: str | None = None,
    act_grad: tuple | None = None,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """[O, N] grouped product (api.py's gmm); rhs is [E, K, N] ([E, N, K] with transpose_rhs).

    `lhs_activation`: lhs is a concatenated hidden [L, n*K], read as act(hidden) (the module
    docstring). `act_grad=(activation, hidden_RH)`: the output is [R, n*N], d hidden of the grouped
    rows (no scattered output)."""
    bm, bk, bn = tile
    num_lhs_rows = lhs_LK.shape[0]
    k_dim = rhs_EKN.shape[2] if transpose_rhs else rhs_EKN.shape[1]
    num_groups = rhs_EKN.shape[0]
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    rows, lead = schedule.plan(
        group_sizes_E, num_lhs_rows, bm, lhs_rows_R, out_rows_R, num_out_rows, zero_unwritten
    )
    load_lhs = _plain_lhs
    if lhs_activation is not None:
        load_lhs = functools.partial(_act_lhs, activation=lhs_activation)
    body = functools.partial(
        _gmm_body, k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk, bn=bn, transpose_rhs=transpose_rhs, load_lhs=load_lhs,
    )  # fmt: skip
    store, extra, out_cols = None, (), n_dim
    if act_grad is not None:
        if out_rows_R is not None or zero_unwritten:  # the epilogue stores grouped rows, every column of H
            raise ValueError("act_grad stores the grouped rows: no out_rows_R, no zero_unwritten")
        activation, hidden_RH = act_grad
        store = functools.partial(_store_act_grad, bm=bm, bn=bn, f_dim=n_dim, activation=activation)
        extra, out_cols = (hidden_RH,), hidden_RH.shape[1]
    kernel = functools.partial(
        schedule.run_gmm, body=body, rows=rows, num_groups=num_groups, k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk,
        bn=bn, interpret=interpret, store=store,
    )  # fmt: skip
    rhs_2d = rhs_EKN.reshape(-1, rhs_EKN.shape[2])
    return pl.pallas_call(
        lambda *refs: kernel(refs),
        out_shape=jax.ShapeDtypeStruct((rows.num_out_rows, out_cols), out_dtype),
        grid=(schedule.num_programs(lead[0].shape[0], rows, n_dim, bm, bn),),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="xmoe_gmm" if lhs_activation is None and act_grad is None else "xmoe_gmm_act",
    )(*lead, lhs_LK, rhs_2d, *extra)


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


def _tgmm_kernel(
    *refs, gather_lhs, gather_grad, num_lhs_rows, num_grad_rows, k_dim, n_dim, bm, bk, bn, activation
):
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
        if activation is None:
            x = _load_chunk(lhs_ref, lhs_rows_ref, row0, row_ok, k0, bk, k_dim, num_lhs_rows, bm)
        else:  # lhs is the concatenated hidden: act(gate, up) of the chunk (the module docstring)
            load = functools.partial(
                _load_chunk, lhs_ref, lhs_rows_ref, row0, row_ok, width=bk, num_ref_rows=num_lhs_rows, bm=bm
            )
            x = _act_tile(load, k0, k_dim, activation, lhs_ref.dtype)
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
    lhs_activation: str | None = None,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """[E, K, N]: per group lhs[rows].T @ grad[rows] (api.py's tgmm; rows through the indices).
    `lhs_activation`: lhs is a concatenated hidden [L, n*K], read as act(hidden)."""
    bm, bk, bn = tile
    k_dim, n_dim = lhs_LK.shape[1], grad_GN.shape[1]
    if lhs_activation is not None:
        k_dim //= num_matrices(lhs_activation)
    num_rows = next((a.shape[0] for a in (lhs_rows_R, grad_rows_R) if a is not None), lhs_LK.shape[0])
    num_groups = group_sizes_E.shape[0]
    starts_E, ends_E = group_bounds(group_sizes_E, num_rows)
    num_programs = num_groups * pl.cdiv(k_dim, bk) * pl.cdiv(n_dim, bn)
    kernel = functools.partial(
        _tgmm_kernel, gather_lhs=lhs_rows_R is not None, gather_grad=grad_rows_R is not None,
        num_lhs_rows=lhs_LK.shape[0], num_grad_rows=grad_GN.shape[0], k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk,
        bn=bn, activation=lhs_activation,
    )  # fmt: skip
    index = tuple(a for a in (lhs_rows_R, grad_rows_R) if a is not None)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups * k_dim, n_dim), out_dtype),
        grid=(num_programs,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="xmoe_tgmm" if lhs_activation is None else "xmoe_tgmm_act",
    )(starts_E, ends_E, *index, lhs_LK, grad_GN)
    return out.reshape(num_groups, k_dim, n_dim)
