"""XLA permute / combine / gather-dot: the oracle and fallback for permute/pallas.py.

Legend: T tokens, D model, K top-k, A = T*K routed copies (copy a = t*K + k belongs to token
t = a // K), R rows of the expert-sorted buffer.

`dest_A[a]` is copy a's row in the sorted buffer; a value outside [0, R) drops the copy.
Valid destinations must be distinct (each buffer row receives at most one copy).

Everything is written as gathers (each output row read from one place and written once),
never as scatter-adds: permute goes through the inverse map `source_rows`, combine gathers
each token's K rows. Arithmetic is in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def valid_dest(dest_A: jax.Array, num_rows: int) -> jax.Array:
    return (dest_A >= 0) & (dest_A < num_rows)


def source_rows(dest_A: jax.Array, num_rows: int) -> jax.Array:
    """Inverse of dest: src_R[r] = the copy a with dest[a] == r, or -1 for rows nobody fills."""
    num_copies = dest_A.shape[0]
    dest_A = jnp.where(valid_dest(dest_A, num_rows), dest_A, num_rows)  # out of range -> dropped
    src_R = jnp.full((num_rows,), -1, jnp.int32)
    return src_R.at[dest_A].set(jnp.arange(num_copies, dtype=jnp.int32), mode="drop", unique_indices=True)


def gather_rows_xla(x_TD, src_R, scale_R, top_k: int) -> jax.Array:
    """out[r] = x[src[r] // K] * scale_R[r] (0 where src[r] < 0)."""
    ok_R = src_R >= 0
    rows_RD = x_TD[jnp.where(ok_R, src_R, 0) // top_k].astype(jnp.float32)
    scale_R = jnp.where(ok_R, scale_R.astype(jnp.float32), 0.0)
    return (rows_RD * scale_R[:, None]).astype(x_TD.dtype)


def scatter_rows_xla(x_TD, dest_TK, weights_TK, num_rows: int) -> jax.Array:
    """out[dest[t,k]] = x[t] * w[t,k] (weights None: 1), as a gather through the inverse map."""
    src_R = source_rows(dest_TK.reshape(-1), num_rows)
    if weights_TK is None:
        scale_R = (src_R >= 0).astype(jnp.float32)
    else:
        scale_R = jnp.where(
            src_R >= 0, weights_TK.reshape(-1).astype(jnp.float32)[jnp.maximum(src_R, 0)], 0.0
        )
    return gather_rows_xla(x_TD, src_R, scale_R, dest_TK.shape[1])


def combine_rows_xla(y_RD, dest_TK, weights_TK) -> jax.Array:
    """out[t] = sum_k w[t,k] * y[dest[t,k]] over valid destinations; weights may be None (ones)."""
    num_rows = y_RD.shape[0]
    ok_TK = valid_dest(dest_TK, num_rows)
    w_TK = ok_TK.astype(jnp.float32)
    if weights_TK is not None:
        w_TK = w_TK * weights_TK.astype(jnp.float32)
    # a select, not a multiply by 0: rows no copy owns may hold anything (gmm leaves them unwritten)
    rows_TKD = jnp.where(ok_TK[:, :, None], y_RD[jnp.where(ok_TK, dest_TK, 0)].astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkd->td", w_TK, rows_TKD).astype(y_RD.dtype)


def gather_dot_xla(a_TD, b_RD, dest_TK) -> jax.Array:
    """out[t,k] = a[t] . b[dest[t,k]] (0 for dropped copies), float32 [T, K]."""
    num_rows = b_RD.shape[0]
    ok_TK = valid_dest(dest_TK, num_rows)
    rows_TKD = b_RD[jnp.where(ok_TK, dest_TK, 0)].astype(jnp.float32)
    out_TK = jnp.einsum("td,tkd->tk", a_TD.astype(jnp.float32), rows_TKD)
    return jnp.where(ok_TK, out_TK, 0.0)
