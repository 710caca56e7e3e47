"""FP8 grouped GEMM as a Triton-style Pallas kernel: fp8 x fp8 dots, float32 accumulation, scales
applied per K-block or in the epilogue.

Legend: R rows grouped by expert, K contraction, N output columns, E experts, B K-blocks of the
scales (see xmoe_jax/fp8/operands.py), I work items (metadata.py); bm/bk/bn the tile.

The same schedule as gmm/pallas.py's gmm (schedule.py: work items, row and column masks, row
indices, fill programs); this file is only its FP8 body, the loads and dots. Loads are masked to the
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

from xmoe_jax.kernels.gmm import schedule
from xmoe_jax.kernels.gmm.fp8_dot import dot_acc

# K elements summed in the tensor core before each float32 add (fp8_dot.py): DeepSeek-V3's 128
IMPRECISE_ACC = 128


def _dot(x, w, acc, transpose_rhs, imprecise_acc):
    if x.dtype != w.dtype:  # e5m2 grads x e4m3 weights: Triton's dot takes one element type
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # exact, at bf16 tensor-core speed
    return dot_acc(x, w, acc, transpose_rhs=transpose_rhs, imprecise_acc=imprecise_acc)


def _gmm_fp8_body(tile, operand_refs, *, k_dim, n_dim, num_kb, bm, bk, bn, transpose_rhs, imprecise_acc):
    """The FP8 K loop of one GEMM program (schedule.py owns the rows, columns and store)."""
    lhs_ref, lhs_s_ref, rhs_ref, rhs_s_ref = operand_refs

    def scales(kb):  # [bm, 1] row scales and [1, bn] column scales of K-block kb
        s_row = schedule.load_rows(lhs_s_ref, tile, kb, 1, bm, other=0.0)
        s_col = plgpu.load(
            rhs_s_ref.at[pl.ds(tile.w_group * num_kb + kb, 1), pl.ds(tile.col0, bn)],
            mask=tile.col_ok[None, :],
            other=0.0,
        )
        return s_row, s_col

    def step(kt, acc):
        k0 = pl.multiple_of(kt * bk, bk)
        x = schedule.load_rows(lhs_ref, tile, k0, bk, bm, other=None)
        if transpose_rhs:
            w = plgpu.load(
                rhs_ref.at[pl.ds(tile.w_group * n_dim + tile.col0, bn), pl.ds(k0, bk)],
                mask=tile.col_ok[:, None],
            )
        else:
            w = plgpu.load(
                rhs_ref.at[pl.ds(tile.w_group * k_dim + k0, bk), pl.ds(tile.col0, bn)],
                mask=tile.col_ok[None, :],
            )
        if num_kb == 1:  # scales in the epilogue: the K loop accumulates in the tensor core's chain
            return _dot(x, w, acc, transpose_rhs, imprecise_acc)
        part = _dot(x, w, jnp.zeros_like(acc), transpose_rhs, imprecise_acc)
        s_row, s_col = scales(kt)
        return acc + part * s_row * s_col

    acc = lax.fori_loop(0, tile.num_k, step, jnp.zeros((bm, bn), jnp.float32))
    if num_kb == 1:
        s_row, s_col = scales(0)
        acc = acc * s_row * s_col
    return acc


def gmm_fp8_pallas(
    lhs_q_LK,
    lhs_s_LB,
    rhs_q_EKN,
    rhs_s_EBN,
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
    imprecise_acc: int = IMPRECISE_ACC,
) -> jax.Array:
    """[O, N] scaled grouped product; rhs_q is [E, K, N] ([E, N, K] with transpose_rhs). Rows as
    gmm/api.py says (lhs_q and lhs_s gathered through lhs_rows_R, the output scattered)."""
    bm, bk, bn = tile
    num_lhs_rows, k_dim = lhs_q_LK.shape
    num_groups = rhs_q_EKN.shape[0]
    n_dim = rhs_q_EKN.shape[1] if transpose_rhs else rhs_q_EKN.shape[2]
    num_kb = lhs_s_LB.shape[1]
    if k_dim % bk:
        raise ValueError(f"K={k_dim} must be a multiple of block_k={bk} (fp8 loads cannot fill masked lanes)")
    if num_kb > 1 and num_kb != pl.cdiv(k_dim, bk):
        raise ValueError(f"block_k={bk} must equal the scales' K-block (K={k_dim}, {num_kb} blocks)")
    rows, lead = schedule.plan(
        group_sizes_E, num_lhs_rows, bm, lhs_rows_R, out_rows_R, num_out_rows, zero_unwritten
    )
    body = functools.partial(
        _gmm_fp8_body, k_dim=k_dim, n_dim=n_dim, num_kb=num_kb, bm=bm, bk=bk, bn=bn,
        transpose_rhs=transpose_rhs, imprecise_acc=imprecise_acc,
    )  # fmt: skip
    kernel = functools.partial(
        schedule.run_gmm, body=body, rows=rows, num_groups=num_groups, k_dim=k_dim, n_dim=n_dim, bm=bm, bk=bk,
        bn=bn, interpret=interpret,
    )  # fmt: skip
    return pl.pallas_call(
        lambda *refs: kernel(refs),
        out_shape=jax.ShapeDtypeStruct((rows.num_out_rows, n_dim), out_dtype),
        grid=(schedule.num_programs(lead[0].shape[0], rows, n_dim, bm, bn),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="xmoe_gmm_fp8",
    )(*lead, lhs_q_LK, lhs_s_LB, rhs_q_EKN.reshape(-1, rhs_q_EKN.shape[2]), rhs_s_EBN.reshape(-1, n_dim))
