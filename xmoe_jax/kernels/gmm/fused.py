"""The expert activation fused into the grouped GEMMs around it: no [R, F] activation array, and no
element-wise pass over rows past sum(group_sizes).

Legend as api.py: R grouped rows, L lhs rows, O output rows, E experts, F expert hidden, D model,
H = n * F the experts' concatenated hidden (activation.py: gate then up for SwiGLU, up for GELU),
N output columns. S = sum(group_sizes) (clipped to R).

    out_ON  = gmm_act(hidden_RH, w_EFN, gs, act, out_rows_R=dst_R, num_out_rows=O)
              # out[dst[r]] = act(hidden[r]) @ w[group(r)]                         (down-projection)
    dh_RH   = gmm_act_grad(dy_LK, w_ENK, gs, hidden_RH, act, lhs_rows_R=src_R)
              # dh[r] = act'(hidden[r]) * (dy[src[r]] @ w[group(r)].T)             (its data gradient)
    dw_EFN  = tgmm_act(hidden_RH, dy_GN, gs, act, grad_rows_R=src_R)
              # dw[e] = sum over rows r of e: act(hidden[r]).T @ dy[src[r]]        (its weight gradient)

On the Pallas backend these are gmm/pallas.py's kernels with the activation in the lhs load (a
prologue) or in the store (an epilogue); rows r >= S are neither read, computed nor stored, so the
work follows the routed rows, not the receive buffer's size. Every other backend runs the XLA
reference: the activation (or its gradient) as an element-wise XLA op over [R, F], beside the
plain grouped GEMM of that backend; so does Pallas for the ops that defaults.FUSED_ACTIVATION does
not fuse: by default none (measured slower at one GPU and at depth: defaults.py); XMOE_FUSED_ACT=kernel
or =grad fuses every op or the d hidden epilogue alone.
Both compute the activation in float32 with the same expressions (activation.py). Rows past S of dh and unwritten output rows are unspecified (the
kernels leave memory as it was; the reference gives zeros), as in api.py.

Not differentiable: they are pieces for an expert layer's own custom VJP, which states the backward
pass itself. The MoE layer (moe/experts.py) does not use them: wired in, they measured slower and
the one-GEMM hidden they read broke remat=full's saving on unrolled layers (benchmarks/fused.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.kernels import backends, defaults
from xmoe_jax.kernels.gmm.activation import act_grad_rows, act_rows, num_matrices
from xmoe_jax.kernels.gmm.api import gathered, gmm, tgmm
from xmoe_jax.kernels.gmm.pallas import gmm_pallas, tgmm_pallas
from xmoe_jax.kernels.vma import match_vma


def _check_hidden(hidden_RH, f_dim: int, activation: str, num_rows: int | None = None) -> None:
    n = num_matrices(activation)
    if hidden_RH.ndim != 2 or hidden_RH.shape[1] != n * f_dim:
        raise ValueError(
            f"hidden must be [R, {n} * F] = [R, {n * f_dim}] for {activation} with F = {f_dim} (the weights'), "
            f"got {hidden_RH.shape}"
        )
    if num_rows is not None and hidden_RH.shape[0] != num_rows:
        raise ValueError(f"hidden has {hidden_RH.shape[0]} rows, the grouped rows are {num_rows}")


def _pallas(fused_op: str, implementation, call: backends.Call):
    """The Pallas backend when `fused_op` fuses on this machine (defaults.activation_in_kernel) and the
    choice for `call` (the plain kernel's) lands on Pallas; else None: the XLA reference."""
    if not defaults.activation_in_kernel(fused_op):
        return None
    backend = backends.choose_backend(implementation, call)
    return backend if backend.name == "pallas" else None


def gmm_act(
    hidden_RH, w_EFN, group_sizes_E, activation: str, *, out_rows_R=None, num_out_rows=None,
    zero_unwritten=False, implementation=None, tile=None,
):  # fmt: skip
    """out[out_rows[r]] = act(hidden[r]) @ w[group(r)] for r < S: [R, N], or [num_out_rows, N]."""
    f_dim, n_dim = w_EFN.shape[1], w_EFN.shape[2]
    _check_hidden(hidden_RH, f_dim, activation)
    hidden_RH, w_EFN = match_vma(hidden_RH, w_EFN)
    num_out = hidden_RH.shape[0] if out_rows_R is None else int(num_out_rows)
    out_ON = jax.ShapeDtypeStruct((num_out, n_dim), hidden_RH.dtype)
    call = backends.Call(
        "gmm", (hidden_RH, w_EFN, out_ON), f_dim, n_dim, tile, indexed=out_rows_R is not None
    )
    backend = _pallas("gmm_act", implementation, call)
    if backend is None:
        return gmm(
            act_rows(hidden_RH, activation), w_EFN, group_sizes_E, out_rows_R=out_rows_R, num_out_rows=num_out_rows,
            zero_unwritten=zero_unwritten, implementation=implementation, tile=tile,
        )  # fmt: skip
    tile = backend.tile("gmm_act", tile)
    return gmm_pallas(
        hidden_RH, w_EFN, group_sizes_E, out_dtype=hidden_RH.dtype, tile=tile, out_rows_R=out_rows_R,
        num_out_rows=num_out_rows, zero_unwritten=zero_unwritten, lhs_activation=activation,
        **backend.launch("gmm_act", tile, hidden_RH.dtype),
    )  # fmt: skip


def gmm_act_grad(
    dy_LK, w_ENK, group_sizes_E, hidden_RH, activation: str, *, lhs_rows_R=None, implementation=None, tile=None,
):  # fmt: skip
    """d hidden [R, H] = act'(hidden) * (dy[lhs_rows[r]] @ w[group(r)].T) for r < S (w is the forward's
    [E, F, D] down-projection, used transposed); rows past S unspecified."""
    f_dim = w_ENK.shape[1]
    num_rows = dy_LK.shape[0] if lhs_rows_R is None else lhs_rows_R.shape[0]
    _check_hidden(hidden_RH, f_dim, activation, num_rows)
    dy_LK, w_ENK, hidden_RH = match_vma(dy_LK, w_ENK, hidden_RH)
    call = backends.Call("gmm", (dy_LK, w_ENK, hidden_RH), dy_LK.shape[1], f_dim, tile, indexed=True)
    backend = _pallas("gmm_act_grad", implementation, call)
    if backend is None:
        d_act_RF = gmm(
            dy_LK, w_ENK, group_sizes_E, transpose_rhs=True, lhs_rows_R=lhs_rows_R, implementation=implementation,
            preferred_element_type=jnp.float32, tile=tile,
        )  # fmt: skip
        return act_grad_rows(hidden_RH, d_act_RF, activation)
    tile = backend.tile("gmm_act_grad", tile)
    return gmm_pallas(
        dy_LK, w_ENK, group_sizes_E, out_dtype=hidden_RH.dtype, tile=tile, transpose_rhs=True,
        lhs_rows_R=lhs_rows_R, act_grad=(activation, hidden_RH), **backend.launch("gmm_act_grad", tile, dy_LK.dtype),
    )  # fmt: skip


def tgmm_act(
    hidden_RH, dy_GN, group_sizes_E, activation: str, *, grad_rows_R=None, implementation=None, tile=None
):
    """dw [E, F, N] = sum over the rows r of group e: act(hidden[r]).T @ dy[grad_rows[r]]; zeros for
    empty groups. In dy's dtype, float32 accumulation."""
    f_dim = hidden_RH.shape[1] // num_matrices(activation)
    _check_hidden(hidden_RH, f_dim, activation)
    hidden_RH, dy_GN = match_vma(hidden_RH, dy_GN)
    n_dim = dy_GN.shape[1]
    out_EFN = jax.ShapeDtypeStruct((group_sizes_E.shape[0], f_dim, n_dim), dy_GN.dtype)
    call = backends.Call(
        "tgmm", (hidden_RH, dy_GN, out_EFN), f_dim, n_dim, tile, indexed=grad_rows_R is not None
    )
    backend = _pallas("tgmm_act", implementation, call)
    if backend is None:
        return tgmm(act_rows(hidden_RH, activation), dy_GN, group_sizes_E, grad_rows_R=grad_rows_R,
                    implementation=implementation, tile=tile)  # fmt: skip
    if grad_rows_R is not None and not defaults.tgmm_gathers_in_kernel():  # as api.py's tgmm: XLA gathers
        dy_GN, grad_rows_R = gathered(dy_GN, grad_rows_R), None
    tile = backend.tile("tgmm_act", tile)
    return tgmm_pallas(
        hidden_RH, dy_GN, group_sizes_E, out_dtype=dy_GN.dtype, tile=tile, grad_rows_R=grad_rows_R,
        lhs_activation=activation, **backend.launch("tgmm_act", tile, hidden_RH.dtype),
    )  # fmt: skip
