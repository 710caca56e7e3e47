"""Grouped matrix multiplies, the MoE expert GEMMs: `gmm` (forward) and `tgmm` (weight gradient).

Legend: R rows of the expert-sorted buffer, K contraction, N output columns, E experts.

    out_RN   = gmm(lhs_RK, rhs_EKN, group_sizes_E)   # out[r] = lhs[r] @ rhs[group(r)]
    grad_EKN = tgmm(lhs_RK, grad_RN, group_sizes_E)  # grad[e] = lhs[rows(e)].T @ grad[rows(e)]

Rows are grouped contiguously: group e owns rows [sum(gs[:e]), sum(gs[:e+1])); rows past
sum(gs) give zeros in gmm and are ignored by tgmm. Inputs are bf16/f16/f32 with one dtype,
accumulation is float32, the output takes lhs's dtype unless `preferred_element_type`.

Both are `jax.custom_vjp` functions whose backward passes are again grouped GEMMs, run by
the same backend (autodiff does not pass through pallas_call or triton_call):
    gmm:  d lhs = gmm(grad, rhs^T)            d rhs  = tgmm(lhs, grad)   (tgmm(grad, lhs) for rhs^T)
    tgmm: d lhs = gmm(grad, cot^T)            d grad = gmm(lhs, cot)
The cotangent is cast to the input dtype before the backward GEMMs (mixed-precision habit).
`implementation` picks the backend (backends.py); every backend falls back to XLA.
"""

from __future__ import annotations

import functools

import jax

from xmoe_jax.kernels import backends  # a module import: backends.py imports this package's kernels
from xmoe_jax.kernels.validation import check_gmm_args, check_tgmm_args, out_dtype
from xmoe_jax.kernels.vma import match_vma


def _gmm_impl(lhs_RK, rhs_EKN, group_sizes_E, impl, out_dt, tile, transpose_rhs=False):
    """Run one forward-style grouped GEMM on `impl` (None: platform default) or its fallback."""
    n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    out_RN = jax.ShapeDtypeStruct((lhs_RK.shape[0], n_dim), out_dt)
    call = backends.Call("gmm", (lhs_RK, rhs_EKN, out_RN), lhs_RK.shape[1], n_dim, tile)
    backend = backends.choose_backend(impl, call)
    return backend.gmm(
        lhs_RK, rhs_EKN, group_sizes_E, out_dtype=out_dt, tile=tile, transpose_rhs=transpose_rhs
    )


def _tgmm_impl(lhs_RK, grad_RN, group_sizes_E, impl, out_dt, tile):
    """Run one weight-gradient grouped GEMM on `impl` (None: platform default) or its fallback."""
    e_dim, k_dim, n_dim = group_sizes_E.shape[0], lhs_RK.shape[1], grad_RN.shape[1]
    out_EKN = jax.ShapeDtypeStruct((e_dim, k_dim, n_dim), out_dt)
    call = backends.Call("tgmm", (lhs_RK, grad_RN, out_EKN), k_dim, n_dim, tile)
    backend = backends.choose_backend(impl, call)
    return backend.tgmm(lhs_RK, grad_RN, group_sizes_E, out_dtype=out_dt, tile=tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm(lhs_RK, rhs_EKN, group_sizes_E, impl, out_dt, tile, transpose_rhs):
    return _gmm_impl(lhs_RK, rhs_EKN, group_sizes_E, impl, out_dt, tile, transpose_rhs)


def _gmm_fwd(lhs_RK, rhs_EKN, group_sizes_E, impl, out_dt, tile, transpose_rhs):
    out_RN = _gmm_impl(lhs_RK, rhs_EKN, group_sizes_E, impl, out_dt, tile, transpose_rhs)
    return out_RN, (lhs_RK, rhs_EKN, group_sizes_E)


def _gmm_bwd(impl, out_dt, tile, transpose_rhs, res, grad_RN):
    lhs_RK, rhs_EKN, group_sizes_E = res
    grad_RN = grad_RN.astype(lhs_RK.dtype)
    dlhs_RK = _gmm_impl(grad_RN, rhs_EKN, group_sizes_E, impl, lhs_RK.dtype, tile, not transpose_rhs)
    if transpose_rhs:  # rhs is [E, N, K]: its gradient is grad.T @ lhs per group
        drhs = _tgmm_impl(grad_RN, lhs_RK, group_sizes_E, impl, rhs_EKN.dtype, tile)
    else:
        drhs = _tgmm_impl(lhs_RK, grad_RN, group_sizes_E, impl, rhs_EKN.dtype, tile)
    return dlhs_RK, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tgmm(lhs_RK, grad_RN, group_sizes_E, impl, out_dt, tile):
    return _tgmm_impl(lhs_RK, grad_RN, group_sizes_E, impl, out_dt, tile)


def _tgmm_fwd(lhs_RK, grad_RN, group_sizes_E, impl, out_dt, tile):
    return _tgmm_impl(lhs_RK, grad_RN, group_sizes_E, impl, out_dt, tile), (lhs_RK, grad_RN, group_sizes_E)


def _tgmm_bwd(impl, out_dt, tile, res, cot_EKN):
    # out[e] = lhs_e.T @ grad_e  =>  d lhs_e = grad_e @ cot[e].T,  d grad_e = lhs_e @ cot[e]
    lhs_RK, grad_RN, group_sizes_E = res
    cot_EKN = cot_EKN.astype(lhs_RK.dtype)
    dlhs_RK = _gmm_impl(grad_RN, cot_EKN, group_sizes_E, impl, lhs_RK.dtype, tile, transpose_rhs=True)
    dgrad_RN = _gmm_impl(lhs_RK, cot_EKN, group_sizes_E, impl, grad_RN.dtype, tile)
    return dlhs_RK, dgrad_RN, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


def _normalize_tile(tile):
    return None if tile is None else tuple(int(t) for t in tile)


def gmm(
    lhs_RK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    implementation: str | None = None,
    preferred_element_type=None,
    tile: tuple[int, int, int] | None = None,
    transpose_rhs: bool = False,
) -> jax.Array:
    """Grouped matmul: out[r] = lhs[r] @ rhs[e] for the group e that owns row r; [R, N].

    Args:
      lhs_RK: [R, K] rows sorted by group.
      rhs_EKN: [E, K, N] one weight matrix per group, same dtype as lhs.
      group_sizes_E: [E] int32 rows per group; rows past their sum come out as zeros.
      implementation: "xla", "pallas", "triton", "mgpu" or None (fastest measured for the
        platform; see backends.py). Unavailable backends fall back, ending at "xla".
      preferred_element_type: output dtype (default lhs.dtype); accumulation is float32.
      tile: (block_m, block_k, block_n), powers of 2 for the kernel backends; None = tuned default.
      transpose_rhs: rhs is [E, N, K] and out[r] = lhs[r] @ rhs[e].T (no transposed copy is made;
        this is how gmm's own lhs gradient runs).

    Differentiable in lhs and rhs (custom VJP: dlhs = gmm(grad, rhs^T), drhs = tgmm(lhs, grad)).
    """
    check_gmm_args(lhs_RK, rhs_EKN, group_sizes_E, transpose_rhs=transpose_rhs)
    out_dt = out_dtype(lhs_RK.dtype, preferred_element_type)
    backends.check_name(implementation)
    tile = _normalize_tile(tile)
    lhs_RK, rhs_EKN = match_vma(lhs_RK, rhs_EKN)
    return _gmm(lhs_RK, rhs_EKN, group_sizes_E, implementation, out_dt, tile, bool(transpose_rhs))


def tgmm(
    lhs_RK: jax.Array,
    grad_RN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    implementation: str | None = None,
    preferred_element_type=None,
    tile: tuple[int, int, int] | None = None,
) -> jax.Array:
    """Per-group lhs^T @ grad: out[e] = lhs[rows(e)].T @ grad[rows(e)]; [E, K, N].

    The weight gradient of `gmm`. Empty groups give zeros; rows past sum(group_sizes) are
    ignored. Arguments as in `gmm` (grad plays rhs's dtype role). Differentiable.
    """
    check_tgmm_args(lhs_RK, grad_RN, group_sizes_E)
    out_dt = out_dtype(lhs_RK.dtype, preferred_element_type)
    backends.check_name(implementation)
    lhs_RK, grad_RN = match_vma(lhs_RK, grad_RN)
    return _tgmm(lhs_RK, grad_RN, group_sizes_E, implementation, out_dt, _normalize_tile(tile))
