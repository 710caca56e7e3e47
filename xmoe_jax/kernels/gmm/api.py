"""Grouped matrix multiplies, the MoE expert GEMMs: `gmm` (forward) and `tgmm` (weight gradient).

Legend: R grouped rows (the GEMM's rows, grouped contiguously by expert), L lhs rows, O output
rows, K contraction, N output columns, E experts; S = sum(group_sizes), clipped to R.

    out_RN   = gmm(lhs_RK, rhs_EKN, group_sizes_E)    # out[r] = lhs[r] @ rhs[group(r)]
    grad_EKN = tgmm(lhs_RK, grad_RN, group_sizes_E)   # grad[e] = lhs[rows(e)].T @ grad[rows(e)]

Row-indexed, the MoE permutes folded into the GEMM's loads and stores (vLLM's fused_moe pattern):

    out_ON   = gmm(lhs_LK, rhs_EKN, gs, lhs_rows_R=src_R, out_rows_R=dst_R, num_out_rows=O)
               # out[dst[r]] = lhs[src[r]] @ rhs[group(r)]             for r < S
    grad_EKN = tgmm(lhs_LK, grad_GN, gs, lhs_rows_R=a_R, grad_rows_R=b_R)
               # grad[e] = sum over rows r of e: lhs[a[r]].T @ grad[b[r]]

Grouped row r in [0, R) is a row of the GEMM (group e owns rows [sum(gs[:e]), sum(gs[:e+1]))).
Without an index, lhs row r / output row r is grouped row r. Rows r >= S are neither read,
computed nor stored, and their index entries are ignored: pad the index list, never the
tensor. An index outside its array's rows reads zeros / is not stored. `out_rows_R` must name
distinct rows among r < S. Unwritten output rows (rows >= S of a grouped output; rows that no
r < S names in a scattered one) are zeros with `zero_unwritten=True` (written by fill programs
that touch only those rows), and unspecified otherwise: the XLA reference gives zeros, the
kernels leave the memory as it was (interpret mode: NaN), so a consumer must read written rows
only. Inputs are bf16/f16/f32 with one dtype, accumulation is float32, the output takes lhs's
dtype unless `preferred_element_type`.

Both are `jax.custom_vjp` functions whose backward passes are again row-indexed grouped GEMMs,
run by the same backend (autodiff does not pass through pallas_call or triton_call):
    gmm:  d lhs = gmm(grad, rhs^T), gathered at out_rows and scattered to lhs_rows (zeros in
          rows nobody reads); d rhs = tgmm(lhs, grad) gathered at lhs_rows and out_rows
          (tgmm(grad, lhs) for rhs^T);
    tgmm: d lhs = gmm(grad, cot^T)   d grad = gmm(lhs, cot), each gathered at the other's rows
          and scattered to its own.
A scattered gradient needs every row of its target read at most once (`distinct_rows=True`:
the arrival buffer of a multi-peer exchange). Otherwise (a token read by its K copies) it is
computed in grouped order and summed into its rows by an XLA scatter-add; the MoE layer keeps
that case on its permute/combine path instead (moe/experts.py). The cotangent is cast to the
input dtype before the backward GEMMs (mixed-precision habit). `implementation` picks the
backend (backends.py); every backend falls back to XLA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.kernels import backends, defaults  # module imports: backends.py imports this package's kernels
from xmoe_jax.kernels.gmm.xla import gather_rows, live_rows
from xmoe_jax.kernels.validation import (
    check_gmm_args,
    check_out_rows,
    check_row_index,
    check_tgmm_args,
    out_dtype,
)
from xmoe_jax.kernels.vma import match_vma


class _Static(NamedTuple):
    """gmm's static arguments (hashable: custom_vjp's nondiff argument)."""

    num_out_rows: int | None
    zero_unwritten: bool
    distinct_rows: bool
    impl: str | None
    out_dt: object
    tile: tuple[int, int, int] | None
    transpose_rhs: bool


def _gmm_impl(lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R, st: _Static):
    """Run one forward-style grouped GEMM on `st.impl` (None: platform default) or its fallback."""
    n_dim = rhs_EKN.shape[1] if st.transpose_rhs else rhs_EKN.shape[2]
    if lhs_rows_R is not None and out_rows_R is None and not defaults.gmm_gathers_in_kernel():
        lhs_LK, lhs_rows_R = gathered(lhs_LK, lhs_rows_R), None  # XLA gathers, the plain kernel runs
    num_rows = lhs_LK.shape[0] if lhs_rows_R is None else lhs_rows_R.shape[0]
    num_out = num_rows if out_rows_R is None else st.num_out_rows
    out_ON = jax.ShapeDtypeStruct((num_out, n_dim), st.out_dt)
    indexed = lhs_rows_R is not None or out_rows_R is not None
    call = backends.Call("gmm", (lhs_LK, rhs_EKN, out_ON), lhs_LK.shape[1], n_dim, st.tile, indexed=indexed)
    backend = backends.choose_backend(st.impl, call)
    return backend.gmm(
        lhs_LK, rhs_EKN, group_sizes_E, out_dtype=st.out_dt, tile=st.tile, transpose_rhs=st.transpose_rhs,
        lhs_rows_R=lhs_rows_R, out_rows_R=out_rows_R, num_out_rows=st.num_out_rows if indexed else None,
        zero_unwritten=st.zero_unwritten,
    )  # fmt: skip


def gathered(x_XK, rows_R):
    """x's rows in grouped order, or x itself without an index (rows past the groups are never
    read: any index, filled with 0)."""
    return x_XK if rows_R is None else gather_rows(x_XK, rows_R)


def shared_rows(x_XK, rows_R):
    """(x, rows) for a gmm and a tgmm that read the same rows of x through one index (the backward of
    a down-projection: d act = dy[rows] W^T and d W = act^T dy[rows]). Where XLA gathers tgmm's rows
    anyway (`defaults.tgmm_gathers_in_kernel` False: CUDA, ROCm), they are gathered once here and both
    GEMMs read the grouped copy, so the gmm runs on the plain kernel (ws on Hopper, which has no
    gather) instead of gathering the same rows a second time on load; elsewhere the index goes on
    to the kernels."""
    if rows_R is None or defaults.tgmm_gathers_in_kernel():
        return x_XK, rows_R
    return gathered(x_XK, rows_R), None


def _tgmm_impl(lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R, impl, out_dt, tile):
    """Run one weight-gradient grouped GEMM on `impl` (None: platform default) or its fallback."""
    e_dim, k_dim, n_dim = group_sizes_E.shape[0], lhs_LK.shape[1], grad_GN.shape[1]
    out_EKN = jax.ShapeDtypeStruct((e_dim, k_dim, n_dim), out_dt)
    if not defaults.tgmm_gathers_in_kernel():  # XLA gathers the rows, the plain kernel reduces them
        lhs_LK, lhs_rows_R = gathered(lhs_LK, lhs_rows_R), None
        grad_GN, grad_rows_R = gathered(grad_GN, grad_rows_R), None
    indexed = lhs_rows_R is not None or grad_rows_R is not None
    call = backends.Call("tgmm", (lhs_LK, grad_GN, out_EKN), k_dim, n_dim, tile, indexed=indexed)
    backend = backends.choose_backend(impl, call)
    return backend.tgmm(
        lhs_LK,
        grad_GN,
        group_sizes_E,
        out_dtype=out_dt,
        tile=tile,
        lhs_rows_R=lhs_rows_R,
        grad_rows_R=grad_rows_R,
    )


def _scatter_back(x_XK, w, group_sizes_E, src_R, dst_R, num_dst, st: _Static, transpose_rhs, out_dt):
    """A gradient into another array's row space: d[dst[r]] = x[src[r]] @ w[group(r)] (w^T with
    transpose_rhs) for r < S, zeros in rows no r names; rows that dst names twice are summed."""
    back = st._replace(zero_unwritten=True, transpose_rhs=transpose_rhs, out_dt=out_dt, num_out_rows=num_dst)
    if dst_R is None or st.distinct_rows:
        return _gmm_impl(
            x_XK,
            w,
            group_sizes_E,
            src_R,
            dst_R,
            back if dst_R is not None else back._replace(num_out_rows=None),
        )
    d_RK = _gmm_impl(
        x_XK, w, group_sizes_E, src_R, None, back._replace(num_out_rows=None, out_dt=jnp.float32)
    )
    dest_R = jnp.where(live_rows(group_sizes_E, dst_R.shape[0]), dst_R, num_dst)
    d_DK = jnp.zeros((num_dst, d_RK.shape[1]), jnp.float32).at[dest_R].add(d_RK, mode="drop")
    return d_DK.astype(out_dt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm(lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R, st: _Static):
    return _gmm_impl(lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R, st)


def _gmm_fwd(lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R, st):
    out = _gmm_impl(lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R, st)
    return out, (lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R)


def _gmm_bwd(st, res, grad_ON):
    lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R = res
    grad_ON = grad_ON.astype(lhs_LK.dtype)
    # d lhs[lhs_rows[r]] = grad[out_rows[r]] @ rhs[e]^T: grad gathered, scattered into lhs's rows
    dlhs_LK = _scatter_back(
        grad_ON, rhs_EKN, group_sizes_E, out_rows_R, lhs_rows_R, lhs_LK.shape[0], st, not st.transpose_rhs,
        lhs_LK.dtype,
    )  # fmt: skip
    if st.transpose_rhs:  # rhs is [E, N, K]: its gradient is grad.T @ lhs per group
        drhs = _tgmm_impl(
            grad_ON, lhs_LK, group_sizes_E, out_rows_R, lhs_rows_R, st.impl, rhs_EKN.dtype, st.tile
        )
    else:
        drhs = _tgmm_impl(
            lhs_LK, grad_ON, group_sizes_E, lhs_rows_R, out_rows_R, st.impl, rhs_EKN.dtype, st.tile
        )
    return dlhs_LK, drhs, None, None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _tgmm(lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R, st: _Static):
    return _tgmm_impl(lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R, st.impl, st.out_dt, st.tile)


def _tgmm_fwd(lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R, st):
    out = _tgmm_impl(lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R, st.impl, st.out_dt, st.tile)
    return out, (lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R)


def _tgmm_bwd(st, res, cot_EKN):
    # out[e] = sum_r lhs[a_r]^T grad[b_r]  =>  d lhs[a_r] = grad[b_r] @ cot[e]^T,  d grad[b_r] = lhs[a_r] @ cot[e]
    lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R = res
    cot_EKN = cot_EKN.astype(lhs_LK.dtype)
    dlhs_LK = _scatter_back(
        grad_GN, cot_EKN, group_sizes_E, grad_rows_R, lhs_rows_R, lhs_LK.shape[0], st, True, lhs_LK.dtype
    )
    dgrad_GN = _scatter_back(
        lhs_LK, cot_EKN, group_sizes_E, lhs_rows_R, grad_rows_R, grad_GN.shape[0], st, False, grad_GN.dtype
    )
    return dlhs_LK, dgrad_GN, None, None, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


def _normalize_tile(tile):
    return None if tile is None else tuple(int(t) for t in tile)


def gmm(
    lhs_LK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    lhs_rows_R: jax.Array | None = None,
    out_rows_R: jax.Array | None = None,
    num_out_rows: int | None = None,
    distinct_rows: bool = False,
    zero_unwritten: bool = False,
    implementation: str | None = None,
    preferred_element_type=None,
    tile: tuple[int, int, int] | None = None,
    transpose_rhs: bool = False,
) -> jax.Array:
    """Grouped matmul: out[out_rows[r]] = lhs[lhs_rows[r]] @ rhs[e] for the group e that owns
    grouped row r < sum(group_sizes); [R, N], or [num_out_rows, N] with out_rows_R.

    Args:
      lhs_LK: [L, K] rows; without lhs_rows_R they are the grouped rows (L = R), sorted by group.
      rhs_EKN: [E, K, N] one weight matrix per group, same dtype as lhs.
      group_sizes_E: [E] int32 grouped rows per group; S = their sum (clipped to R).
      lhs_rows_R: optional int32 [R]: grouped row r reads lhs row lhs_rows_R[r] (gather on load).
      out_rows_R: optional int32 [R]: grouped row r writes output row out_rows_R[r] (scatter on
        store; distinct among r < S), of an output with `num_out_rows` rows (static).
      distinct_rows: lhs_rows_R names each lhs row at most once among r < S, so lhs's gradient is
        a scattered gmm; False sums it with an XLA scatter-add.
      zero_unwritten: output rows that no r < S writes are zeros (fill programs that write only
        those rows); default False: they are unspecified and nothing spends a cycle on them.
      implementation: "xla", "pallas", "triton", "mgpu" or None (fastest measured for the
        platform; see backends.py). Unavailable backends fall back, ending at "xla".
      preferred_element_type: output dtype (default lhs.dtype); accumulation is float32.
      tile: (block_m, block_k, block_n), powers of 2 for the kernel backends; None = tuned default.
      transpose_rhs: rhs is [E, N, K] and out[r] = lhs[r] @ rhs[e].T (no transposed copy is made;
        this is how gmm's own lhs gradient runs).

    Differentiable in lhs and rhs (custom VJP; see the module docstring).
    """
    check_gmm_args(lhs_LK, rhs_EKN, group_sizes_E, transpose_rhs=transpose_rhs)
    num_rows = lhs_LK.shape[0]
    if lhs_rows_R is not None:
        check_row_index("lhs_rows_R", lhs_rows_R)
        num_rows = lhs_rows_R.shape[0]
    check_out_rows(out_rows_R, num_out_rows)
    if out_rows_R is not None:
        other = "lhs_rows_R.shape[0]" if lhs_rows_R is not None else "lhs.shape[0]"
        check_row_index("out_rows_R", out_rows_R, num_rows, other)
    out_dt = out_dtype(lhs_LK.dtype, preferred_element_type)
    backends.check_name(implementation)
    st = _Static(
        None if num_out_rows is None else int(num_out_rows), bool(zero_unwritten), bool(distinct_rows),
        implementation, out_dt, _normalize_tile(tile), bool(transpose_rhs),
    )  # fmt: skip
    lhs_LK, rhs_EKN = match_vma(lhs_LK, rhs_EKN)
    return _gmm(lhs_LK, rhs_EKN, group_sizes_E, lhs_rows_R, out_rows_R, st)


def tgmm(
    lhs_LK: jax.Array,
    grad_GN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    lhs_rows_R: jax.Array | None = None,
    grad_rows_R: jax.Array | None = None,
    distinct_rows: bool = False,
    implementation: str | None = None,
    preferred_element_type=None,
    tile: tuple[int, int, int] | None = None,
) -> jax.Array:
    """Per-group lhs^T @ grad over the grouped rows: out[e] = sum_{r in e} lhs[a_r].T @ grad[b_r]
    with a = lhs_rows_R, b = grad_rows_R (identity when not given); [E, K, N].

    The weight gradient of `gmm`. Empty groups give zeros; rows r >= sum(group_sizes) are
    ignored. `distinct_rows`: each index names its array's rows at most once among r < S (for
    the scattered gradients of tgmm's own VJP). Other arguments as in `gmm` (grad plays rhs's
    dtype role). Differentiable.
    """
    num_rows = next((a.shape[0] for a in (lhs_rows_R, grad_rows_R) if a is not None), None)
    for name, rows_R in (("lhs_rows_R", lhs_rows_R), ("grad_rows_R", grad_rows_R)):
        if rows_R is not None:
            check_row_index(name, rows_R, num_rows, "the other row index's length")
    check_tgmm_args(lhs_LK, grad_GN, group_sizes_E, same_rows=num_rows is None)
    if num_rows is not None and lhs_rows_R is None:  # lhs rows are the grouped rows
        check_row_index("grad_rows_R", grad_rows_R, lhs_LK.shape[0], "lhs.shape[0]")
    if num_rows is not None and grad_rows_R is None:
        check_row_index("lhs_rows_R", lhs_rows_R, grad_GN.shape[0], "grad.shape[0]")
    out_dt = out_dtype(lhs_LK.dtype, preferred_element_type)
    backends.check_name(implementation)
    st = _Static(None, True, bool(distinct_rows), implementation, out_dt, _normalize_tile(tile), False)
    lhs_LK, grad_GN = match_vma(lhs_LK, grad_GN)
    return _tgmm(lhs_LK, grad_GN, group_sizes_E, lhs_rows_R, grad_rows_R, st)
