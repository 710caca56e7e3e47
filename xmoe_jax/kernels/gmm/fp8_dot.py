"""`dot_acc`: acc + x @ w inside a Pallas Triton kernel, with control of FP8 accumulation.

Legend: bm, bk, bn the kernel's tile; x [bm, bk], w [bk, bn] (or [bn, bk] with transpose_rhs),
acc [bm, bn] float32.

    acc = dot_acc(x, w, acc, transpose_rhs=False, imprecise_acc=128)

Why a primitive of our own: Hopper's FP8 tensor cores (wgmma) accumulate in fewer than float32's
bits, so Triton's `tt.dot` carries `maxNumImpreciseAcc`: how many K elements may be summed inside
the tensor core before the partial sum is added into a float32 register accumulator. Pallas
lowers `lax.dot_general` to a `tt.dot` without the attribute, i.e. 0: a float32 add after every
32-wide wgmma, which serialises the wgmma pipeline. Our FP8 kernel ran at 0.55x our bf16 kernel
that way (benchmarks/fp8.md). Triton's own default on sm_90 is 2^30 (never promote; torch's
`use_fast_accum=True`). DeepSeek-V3 promotes every 128 elements of K; `imprecise_acc=128` with
block_k=128 is that recipe, one float32 add per K tile.

The Triton lowering rule passes the accumulator straight into `tt.dot` (d = a @ b + c). Off-GPU
(interpret mode, the XLA lowering) the primitive is `acc + dot_general(x, w)` in float32.
Registered with Pallas's Triton lowering (a private table, present in jax 0.10-0.12) on import.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

dot_acc_p = Primitive("xmoe_dot_acc")

_NN = (((1,), (0,)), ((), ()))  # x[m,k] @ w[k,n]
_NT = (((1,), (1,)), ((), ()))  # x[m,k] @ w[n,k].T


def dot_acc(x, w, acc, *, transpose_rhs: bool = False, imprecise_acc: int = 0):
    """acc + x @ w (x @ w.T with transpose_rhs) in float32; `imprecise_acc` as the module says."""
    return dot_acc_p.bind(x, w, acc, transpose_rhs=bool(transpose_rhs), imprecise_acc=int(imprecise_acc))


def _reference(x, w, acc, *, transpose_rhs, imprecise_acc):
    del imprecise_acc  # float32 throughout: the most precise accumulation
    dims = _NT if transpose_rhs else _NN
    return acc + lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def _abstract_eval(x, w, acc, *, transpose_rhs, imprecise_acc):
    del imprecise_acc
    m, k = x.shape
    n, k_w = (w.shape[0], w.shape[1]) if transpose_rhs else (w.shape[1], w.shape[0])
    if k != k_w or acc.shape != (m, n) or acc.dtype != jnp.float32:
        raise TypeError(f"dot_acc: x {x.shape}, w {w.shape} (transpose_rhs={transpose_rhs}), acc {acc}")
    return acc


def _triton_rule(ctx, x, w, acc, *, transpose_rhs, imprecise_acc):
    from jax._src.pallas.triton import lowering

    x_aval, w_aval, _ = ctx.avals_in
    if x_aval.dtype != w_aval.dtype:
        raise TypeError(
            f"dot_acc on the Triton path needs one operand dtype, got {x_aval.dtype}, {w_aval.dtype}"
        )
    if transpose_rhs:
        w = lowering.tt_dialect.trans(w, (1, 0))
    return lowering.tt_dialect.dot(x, w, acc, max_num_imprecise_acc=imprecise_acc)


def _register_triton() -> None:
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # a jax without Pallas's Triton lowering: only interpret mode can run the kernel
        return
    lowering.triton_lowering_rules[dot_acc_p] = _triton_rule


dot_acc_p.def_impl(_reference)
dot_acc_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dot_acc_p, mlir.lower_fun(_reference, multiple_results=False))
_register_triton()
