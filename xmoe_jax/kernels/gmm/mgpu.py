"""Hopper fast path: JAX's bundled Mosaic-GPU ragged dots, wrapped to gmm / tgmm semantics.

Legend: R rows grouped by expert, K contraction, N output columns, E experts.

`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (wgmma + TMA pipelines,
persistent grid over the SMs) serves gmm and, with `transpose_rhs=True`, gmm's lhs gradient;
`transposed_ragged_dot_mgpu.transposed_ragged_dot` serves tgmm. Both are imported only when
called (NVIDIA Hopper only). Their constraints, checked by `shape_reason` so backends.py
can fall back before tracing: equal 16-bit input dtypes, K a multiple of block_k (gmm), K and
N multiples of block_m/block_n (tgmm). No row indices: Hopper has no TMA gather (sm100's
gather4/scatter4 only), so an indexed call falls back to the Pallas kernel (backends.py).

Padding (what JAX's kernel does; read in jax 0.10.2's ragged_dot_mgpu.py): `ragged_dot` runs a
persistent loop over a static grid of cdiv(R, block_m) + E - 1 row tiles x N tiles. Each step
finds its (group, row tile) from the group sizes; a step that matches none (the tiles the rows
past sum(group_sizes) leave over, and some empty groups) falls back to row tile 0 of expert 0
and runs the full K pipeline (TMA loads and wgmma) before storing zero rows. So padding costs
GEMM time here but is never stored: tokamax's sm90 kernel skips such steps up front
(`@pl.when(actual_size > 0)`), and a patch of that kind belongs in JAX. Rows past the sum are
left unwritten, which gmm's contract allows; with `zero_unwritten` we zero them with a select
that XLA fuses into the consumer. `transposed_ragged_dot` (tgmm) loops over each group's rows.

Measured on one H100 (scripts/bench_gmm.py): 36-45% of a same-shape dense matmul in fwd and
dgrad, 51-70% in wgrad -- behind the Triton-style kernels, so it is opt-in, not the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Mosaic pipeline depth and N-panel width of the persistent loop (untuned).
MAX_CONCURRENT_STEPS = 4
GRID_BLOCK_N = 1


def shape_reason(op: str, dtype, k_dim: int, n_dim: int, tile) -> str | None:
    """Why the Mosaic kernels cannot take this call, or None."""
    bm, bk, bn = tile
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bfloat16/float16 inputs, got {jnp.dtype(dtype)}"
    if op == "gmm" and k_dim % bk:
        return f"K={k_dim} is not a multiple of block_k={bk}"
    if op == "gmm" and n_dim % bn:
        return f"N={n_dim} is not a multiple of block_n={bn}"
    if op == "tgmm" and (k_dim % bk or n_dim % bn):
        return f"K={k_dim}, N={n_dim} must be multiples of ({bk}, {bn})"
    return None


def zero_tail(out_RN, group_sizes_E):
    """out with its rows past sum(group_sizes) zeroed (a select XLA fuses into the consumer)."""
    rows_R = jnp.arange(out_RN.shape[0], dtype=jnp.int32)
    return jnp.where((rows_R < jnp.sum(group_sizes_E))[:, None], out_RN, 0)


def gmm_mgpu(
    lhs_RK, rhs_EKN, group_sizes_E, *, out_dtype, tile, transpose_rhs: bool = False, zero_unwritten=False
):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    bm, bk, bn = tile
    out = ragged_dot_mgpu.ragged_dot(
        lhs_RK,
        rhs_EKN,
        group_sizes=group_sizes_E,
        block_m=bm,
        block_n=bn,
        block_k=bk,
        max_concurrent_steps=MAX_CONCURRENT_STEPS,
        grid_block_n=GRID_BLOCK_N,
        transpose_rhs=transpose_rhs,
    )
    return (zero_tail(out, group_sizes_E) if zero_unwritten else out).astype(out_dtype)


def tgmm_mgpu(lhs_RK, grad_RN, group_sizes_E, *, out_dtype, tile) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    bm, bk, bn = tile
    # the Mosaic kernel names the ragged (row) dimension "k": its block_k is our row chunk
    out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs_RK,
        grad_RN,
        group_sizes=group_sizes_E,
        block_m=bk,
        block_n=bn,
        block_k=bm,
        max_concurrent_steps=MAX_CONCURRENT_STEPS,
        grid_block_n=GRID_BLOCK_N,
    )
    return out.astype(out_dtype)
