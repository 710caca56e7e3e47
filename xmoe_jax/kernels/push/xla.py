"""The push exchange's reference: the same rows to the same places, by XLA collectives (any platform).

Legend: N send rows, M receive rows, D row width, P peers, X = P * U updates (update x goes to
peer x // U), C the padded rows per update.

Every update is padded to a static `max_piece` rows and moved by one dense `all_to_all` together
with its destination offset and size; the receiver scatters the rows that are real. It is
`jax.lax.ragged_all_to_all`'s semantics on XLA:CPU, which has none, and the oracle the Mosaic
kernel (mgpu.py) is checked against. Rows no update targets are zeros here (the kernel leaves
them unwritten).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def push_rows_reference(
    x_ND: jax.Array, meta_3X: jax.Array, *, out_rows: int, axis_name: str, max_piece: int
) -> jax.Array:
    """[out_rows, D]: update x's rows x_ND[src[x]:src[x]+size[x]] at dst[x] of peer x // U."""
    src_X, size_X, dst_X = meta_3X[0], meta_3X[1], meta_3X[2]
    rows_C = jnp.arange(max_piece, dtype=jnp.int32)
    take_XC = rows_C[None, :] < size_X[:, None]
    gather_XC = jnp.where(take_XC, src_X[:, None] + rows_C[None, :], x_ND.shape[0])
    pieces_XCD = x_ND.at[gather_XC].get(mode="fill", fill_value=0)
    # update x leaves for peer x // U; what arrives is, per source, the U updates meant for me
    pieces_XCD = jax.lax.all_to_all(pieces_XCD, axis_name, 0, 0, tiled=True)
    size_X = jax.lax.all_to_all(size_X, axis_name, 0, 0, tiled=True)
    dst_X = jax.lax.all_to_all(dst_X, axis_name, 0, 0, tiled=True)
    scatter_XC = jnp.where(rows_C[None, :] < size_X[:, None], dst_X[:, None] + rows_C[None, :], out_rows)
    out_MD = jnp.zeros((out_rows, x_ND.shape[1]), x_ND.dtype)
    return out_MD.at[scatter_XC.reshape(-1)].set(pieces_XCD.reshape(-1, x_ND.shape[1]), mode="drop")
