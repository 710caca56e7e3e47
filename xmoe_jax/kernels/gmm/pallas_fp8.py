"""FP8 grouped GEMM as a Triton-style Pallas kernel: fp8 x fp8 dots, float32 accumulation, scales
applied per K-block or in the epilogue.

Legend: R rows grouped by expert, K contraction, N output columns, E experts, B K-blocks of the
scales (see xmoe_jax/fp8/operands.py), I work items (metadata.py); bm/bk/bn the tile.

Same grid as gmm/pallas.py's gmm (one program per (work item, N tile)). Loads are masked to the
group's rows and the array's columns but not filled: Triton cannot splat a fill value into an
fp8 tensor, so masked lanes hold undefined values. That is harmless for rows and columns (an
output element depends on its own row and column only, and masked ones are never stored) but
not along K, so K must be a multiple of block_k (backends.py refuses other calls). Operands:
lhs_q [R, K] and rhs_q [E, K, N] (or [E, N, K] with transpose_rhs, the K-major layout Hopper's
FP8 tensor cores read without a shared-memory transpose), float32 scales lhs_s [R, B] and
rhs_s [E, B, N]. With B = 1 (tensorwise and rowwise recipes) the K loop is a plain fp8 GEMM and
the epilogue multiplies by lhs_s[row] * rhs_s[col]; with B > 1 (blockwise) block_k must equal
the scales' K-block, and each K step's partial product is scaled before it is accumulated
(DeepSeek-V3's promotion of partial sums to float32 with their scales, on CUDA cores).
The dots go through fp8_dot.dot_acc, which tells Triton how many K elements the tensor core may
sum before a float32 add (`imprecise_acc`: 128 by default, 2^30 for the recipe's fast_accum);
Pallas's own dot said 0, an add after every wgmma (benchmarks/fp8.md, 0.55x bf16 that way).
On CUDA the backend passes the weights K-major (backends.py).
On CPU the kernel runs in interpret mode, where XLA:CPU upcasts the fp8 dot (tests check its
logic there; the GPU check in scripts/bench_fp8.py checks the Triton lowering).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xmoe_jax.kernels.gmm.fp8_dot import dot_acc
from xmoe_jax.kernels.gmm.metadata import make_group_metadata

# K elements summed in the tensor core before each float32 add (fp8_dot.py): DeepSeek-V3's 128
IMPRECISE_ACC = 128


def _dot(x, w, acc, transpose_rhs, imprecise_acc):
    if x.dtype != w.dtype:  # e5m2 grads x e4m3 weights: Triton's dot takes one element type
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # exact, at bf16 tensor-core speed
    return dot_acc(x, w, acc, transpose_rhs=transpose_rhs, imprecise_acc=imprecise_acc)


def _gmm_fp8_kernel(
    item_group_ref,
    item_tile_ref,
    group_start_ref,
    group_end_ref,
    lhs_ref,
    lhs_s_ref,
    rhs_ref,
    rhs_s_ref,
    out_ref,
    *,
    num_groups,
    k_dim,
    n_dim,
    num_kb,
    bm,
    bk,
    bn,
    transpose_rhs,
    imprecise_acc,
):
    n_tiles = pl.cdiv(n_dim, bn)
    pid = pl.program_id(0)
    item, col_tile = pid // n_tiles, pid % n_tiles
    group = item_group_ref[item]
    row0 = pl.multiple_of(item_tile_ref[item] * bm, bm)
    col0 = pl.multiple_of(col_tile * bn, bn)
    rows = row0 + jnp.arange(bm)
    row_ok = (rows >= group_start_ref[group]) & (rows < group_end_ref[group])
    col_ok = (col0 + jnp.arange(bn)) < n_dim
    w_group = jnp.minimum(group, num_groups - 1)  # tail/idle items read group E-1 but never use it

    def scales(kb):  # [bm, 1] row scales and [1, bn] column scales of K-block kb
        s_row = plgpu.load(lhs_s_ref.at[pl.ds(row0, bm), pl.ds(kb, 1)], mask=row_ok[:, None], other=0.0)
        s_col = plgpu.load(
            rhs_s_ref.at[pl.ds(w_group * num_kb + kb, 1), pl.ds(col0, bn)], mask=col_ok[None, :], other=0.0
        )
        return s_row, s_col

    def body(kt, acc):
        k0 = pl.multiple_of(kt * bk, bk)
        x = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=row_ok[:, None])
        if transpose_rhs:
            w = plgpu.load(rhs_ref.at[pl.ds(w_group * n_dim + col0, bn), pl.ds(k0, bk)], mask=col_ok[:, None])
        else:
            w = plgpu.load(rhs_ref.at[pl.ds(w_group * k_dim + k0, bk), pl.ds(col0, bn)], mask=col_ok[None, :])
        if num_kb == 1:  # scales in the epilogue: the K loop accumulates in the tensor core's chain
            return _dot(x, w, acc, transpose_rhs, imprecise_acc)
        part = _dot(x, w, jnp.zeros_like(acc), transpose_rhs, imprecise_acc)
        s_row, s_col = scales(kt)
        return acc + part * s_row * s_col

    num_k = (group < num_groups).astype(jnp.int32) * pl.cdiv(k_dim, bk)
    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    if num_kb == 1:
        s_row, s_col = scales(0)
        acc = acc * s_row * s_col
    plgpu.store(
        out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)],
        acc.astype(out_ref.dtype),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def gmm_fp8_pallas(
    lhs_q_RK,
    lhs_s_RB,
    rhs_q_EKN,
    rhs_s_EBN,
    group_sizes_E,
    *,
    out_dtype,
    tile,
    transpose_rhs: bool = False,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    imprecise_acc: int = IMPRECISE_ACC,
) -> jax.Array:
    """[R, N] scaled grouped product; rhs_q is [E, K, N] ([E, N, K] with transpose_rhs)."""
    bm, bk, bn = tile
    num_rows, k_dim = lhs_q_RK.shape
    num_groups = rhs_q_EKN.shape[0]
    n_dim = rhs_q_EKN.shape[1] if transpose_rhs else rhs_q_EKN.shape[2]
    num_kb = lhs_s_RB.shape[1]
    if k_dim % bk:
        raise ValueError(f"K={k_dim} must be a multiple of block_k={bk} (fp8 loads cannot fill masked lanes)")
    if num_kb > 1 and num_kb != pl.cdiv(k_dim, bk):
        raise ValueError(f"block_k={bk} must equal the scales' K-block (K={k_dim}, {num_kb} blocks)")
    meta = make_group_metadata(group_sizes_E, num_rows, bm)
    num_programs = meta.item_group_I.shape[0] * pl.cdiv(n_dim, bn)
    kernel = functools.partial(
        _gmm_fp8_kernel,
        num_groups=num_groups,
        k_dim=k_dim,
        n_dim=n_dim,
        num_kb=num_kb,
        bm=bm,
        bk=bk,
        bn=bn,
        transpose_rhs=transpose_rhs,
        imprecise_acc=imprecise_acc,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
        grid=(num_programs,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="xmoe_gmm_fp8",
    )(*meta, lhs_q_RK, lhs_s_RB, rhs_q_EKN.reshape(-1, rhs_q_EKN.shape[2]), rhs_s_EBN.reshape(-1, n_dim))
