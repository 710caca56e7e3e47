"""Token permutation for padding-free MoE buffers: `permute` into expert order, `combine` back.

Legend: T tokens, D model, K top-k, A = T*K routed copies (copy a = t*K + k of token t),
R rows of the expert-sorted buffer.

    x_sorted_RD = permute(x_TD, dest_A, num_rows)            # row dest[a] <- x[a // K]
    y_TD        = combine(y_sorted_RD, dest_A, weights_TK)   # y[t] = sum_k w[t,k] * y_sorted[dest[t,k]]

`dest_A` (int32, [A] or [T, K]) gives each copy's row in the sorted buffer; a destination
outside [0, R) drops the copy (capacity overflow), and valid destinations must be distinct.
Buffer rows that receive no copy are zeros. `permute` can scale each copy by its routing
weight (`weights_TK`), e.g. to apply the gate before the experts instead of after.

Custom VJPs, each again a permute or combine (no scatter-adds, no atomics):
    permute: d x = combine(dout, dest, weights or 1)     d weights[t,k] = dout[dest[t,k]] . x[t]
    combine: d y = permute(dout, dest, R, weights)       d weights[t,k] = dout[t] . y[dest[t,k]]
Unweighted (`combine(y, dest_TK)`, weights None), combine keeps no y: its backward is the permute alone.
Backends: "xla" (oracle) and "pallas" (Triton lowering on GPU, interpret on CPU); "triton"
and "mgpu" have no permute kernels of their own and use "pallas". Arithmetic in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax.kernels import backends  # a module import: backends.py imports this package's kernels
from xmoe_jax.kernels.permute.xla import source_rows
from xmoe_jax.kernels.validation import check_float, check_int32, check_rank
from xmoe_jax.kernels.vma import match_vma


def _backend(implementation: str | None, *arrays) -> backends.Backend:
    """The backend for a permute-family call on these operands / result (triton, mgpu: pallas's)."""
    return backends.choose_backend(implementation, backends.Call("permute", arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _permute(x_TD, dest_TK, weights_TK, num_rows, backend):
    return backend.permute(x_TD, dest_TK, weights_TK, num_rows)


def _permute_fwd(x_TD, dest_TK, weights_TK, num_rows, backend):
    return backend.permute(x_TD, dest_TK, weights_TK, num_rows), (x_TD, dest_TK, weights_TK)


def _permute_bwd(num_rows, backend, res, dout_RD):
    x_TD, dest_TK, weights_TK = res
    dx_TD = backend.combine(dout_RD, dest_TK, weights_TK).astype(x_TD.dtype)
    dw_TK = None
    if weights_TK is not None:
        dw_TK = backend.gather_dot(x_TD, dout_RD, dest_TK).astype(weights_TK.dtype)
    return dx_TD, None, dw_TK


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(y_RD, dest_TK, weights_TK, backend):
    return backend.combine(y_RD, dest_TK, weights_TK)


def _combine_fwd(y_RD, dest_TK, weights_TK, backend):
    return backend.combine(y_RD, dest_TK, weights_TK), (y_RD, dest_TK, weights_TK)


def _combine_bwd(backend, res, dout_TD):
    y_RD, dest_TK, weights_TK = res
    dy_RD = backend.permute(dout_TD, dest_TK, weights_TK, y_RD.shape[0]).astype(y_RD.dtype)
    dw_TK = backend.gather_dot(dout_TD, y_RD, dest_TK).astype(weights_TK.dtype)
    return dy_RD, None, dw_TK


_combine.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _sum_rows(y_RD, dest_TK, num_rows, dtype, backend):
    """Unweighted combine; the backward keeps only dest (num_rows and dtype: y's, static)."""
    del num_rows, dtype
    return backend.combine(y_RD, dest_TK, None)


def _sum_rows_fwd(y_RD, dest_TK, num_rows, dtype, backend):
    return _sum_rows(y_RD, dest_TK, num_rows, dtype, backend), dest_TK


def _sum_rows_bwd(num_rows, dtype, backend, dest_TK, dout_TD):
    return backend.permute(dout_TD, dest_TK, None, num_rows).astype(dtype), None


_sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)


def _dest_TK(dest, num_tokens: int, name: str = "dest_A") -> jax.Array:
    check_int32(name, dest)
    if dest.ndim not in (1, 2):
        raise ValueError(f"{name} must have rank 1 ([T*K]) or 2 ([T, K]), got shape {tuple(dest.shape)}")
    if dest.ndim == 2 and dest.shape[0] != num_tokens:
        raise ValueError(
            f"{name}.shape[0] is {dest.shape[0]} but must equal the number of tokens {num_tokens}"
        )
    if num_tokens == 0 or dest.size % num_tokens:
        raise ValueError(f"{name} has {dest.size} copies, not a multiple of the {num_tokens} tokens")
    return dest.reshape(num_tokens, dest.size // num_tokens)


def _check_weights(weights_TK, dest_TK) -> None:
    check_rank("weights_TK", weights_TK, 2, "[tokens, top_k]")
    check_float("weights_TK", weights_TK)
    if weights_TK.shape != dest_TK.shape:
        raise ValueError(
            f"weights_TK has shape {tuple(weights_TK.shape)} but dest gives [T, K] = {tuple(dest_TK.shape)}"
        )


def permute(
    x_TD: jax.Array,
    dest_A: jax.Array,
    num_rows: int,
    weights_TK: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """Gather token rows into expert-sorted order: out[dest[t*K+k]] = x[t] (* weights[t,k]); [R, D].

    Args:
      x_TD: [T, D] tokens (bf16/f16/f32).
      dest_A: int32 [T*K] (or [T, K]) destination row of each copy; outside [0, R) = dropped.
      num_rows: R, rows of the sorted buffer (static).
      weights_TK: optional [T, K] per-copy scale (differentiable).
      implementation: "xla", "pallas" or None (platform default); see backends.py.
    """
    check_rank("x_TD", x_TD, 2, "[tokens, D]")
    check_float("x_TD", x_TD)
    num_rows = int(num_rows)
    if num_rows <= 0:
        raise ValueError(f"num_rows must be positive, got {num_rows}")
    dest_TK = _dest_TK(dest_A, x_TD.shape[0])
    if weights_TK is not None:
        _check_weights(weights_TK, dest_TK)
    out_RD = jax.ShapeDtypeStruct((num_rows, x_TD.shape[1]), x_TD.dtype)
    backend = _backend(implementation, x_TD, out_RD)
    x_TD, weights_TK = match_vma(x_TD, weights_TK)
    return _permute(x_TD, dest_TK, weights_TK, num_rows, backend)


def combine(
    y_RD: jax.Array,
    dest_A: jax.Array,
    weights_TK: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """Weighted sum of each token's K expert rows: out[t] = sum_k w[t,k] * y[dest[t*K+k]]; [T, D].

    Dropped copies (destination outside [0, R)) contribute zero. Differentiable in y and
    weights. Output dtype = y's; accumulation in float32. `weights_TK` None: every weight 1
    (dest_A must then be [T, K]), and the backward pass keeps no y (the weights, folded in before
    the rows came back, carry their own gradient: moe/experts.py).
    """
    check_rank("y_RD", y_RD, 2, "[rows, D]")
    check_float("y_RD", y_RD)
    if weights_TK is None:
        check_rank("dest_A", dest_A, 2, "[tokens, top_k] (combine without weights)")
        dest_TK = _dest_TK(dest_A, dest_A.shape[0])
    else:
        check_rank("weights_TK", weights_TK, 2, "[tokens, top_k]")
        dest_TK = _dest_TK(dest_A, weights_TK.shape[0])
        _check_weights(weights_TK, dest_TK)
    out_TD = jax.ShapeDtypeStruct((dest_TK.shape[0], y_RD.shape[1]), y_RD.dtype)
    backend = _backend(implementation, y_RD, out_TD)
    if weights_TK is None:
        return _sum_rows(y_RD, dest_TK, y_RD.shape[0], y_RD.dtype, backend)
    y_RD, weights_TK = match_vma(y_RD, weights_TK)
    return _combine(y_RD, dest_TK, weights_TK, backend)


def token_rows(dest_A: jax.Array, num_tokens: int, num_rows: int) -> jax.Array:
    """int32 [R]: the token whose copy lands on each buffer row (-1 for rows no copy fills).

    The gather index of `permute`: `gmm(x_TD, w, gs, lhs_rows_R=token_rows(dest, T, R))` reads the
    rows of `permute(x_TD, dest, R)` straight from x_TD, with no permuted copy (gmm/api.py). A
    token's K copies read its row K times, so that gmm's lhs gradient is a sum: keep it on
    `combine` (moe/experts.py), not on gmm's scatter-add fallback.
    """
    dest_TK = _dest_TK(dest_A, num_tokens)
    src_R = source_rows(dest_TK.reshape(-1), int(num_rows))
    return jnp.where(src_R >= 0, src_R // dest_TK.shape[1], -1).astype(jnp.int32)
