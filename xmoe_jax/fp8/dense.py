"""FP8 dense projections: `dot_fp8(x, w, recipe)` ~ x @ w with FP8 operands, a custom_vjp.

Legend: M rows (all leading axes of x flattened), K contraction, N output columns.

How each recipe runs (forward and the input gradient; the weight gradient stays in x's
precision, see recipe.py):
  tensorwise, rowwise  XLA's FP8 dot: lax.dot_general on float8 operands with a float32 result,
                       which XLA lowers to a cuBLASLt FP8 GEMM on Hopper; the row and column
                       scales multiply the result (a fused elementwise epilogue).
  blockwise            the per-K-block scales cannot leave a single dot, so it runs the FP8
                       grouped GEMM (fp8/gmm.py's backend) with one group.
Used by the attention q/k/v/o projections and the dense and shared-expert MLPs when
`model.fp8` is set; embeddings, the LM head, the router, norms and attention scores never are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from xmoe_jax.fp8.gmm import gmm_fp8_quantized
from xmoe_jax.fp8.operands import quantize_lhs, quantize_rhs
from xmoe_jax.fp8.recipe import Recipe


def _matmul(x_MK, w_KN, recipe: Recipe, x_dtype, out_dt):
    x_q, x_s = quantize_lhs(x_MK, recipe, x_dtype)
    w_q, w_s = quantize_rhs(w_KN[None], recipe, recipe.act_dtype)
    if x_s.shape[1] == 1:  # one scale along K: XLA's FP8 dot, scales in the epilogue
        out = lax.dot_general(x_q, w_q[0], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return (out * x_s * w_s[0]).astype(out_dt)
    sizes = jnp.full((1,), x_MK.shape[0], jnp.int32)
    return gmm_fp8_quantized(x_q, x_s, w_q, w_s, sizes, block_k=recipe.block_k, out_dt=out_dt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dot_fp8(x_MK, w_KN, recipe):
    return _matmul(x_MK, w_KN, recipe, recipe.act_dtype, x_MK.dtype)


def _dot_fp8_fwd(x_MK, w_KN, recipe):
    return _matmul(x_MK, w_KN, recipe, recipe.act_dtype, x_MK.dtype), (x_MK, w_KN)


def _dot_fp8_bwd(recipe, res, grad_MN):
    x_MK, w_KN = res
    grad_MN = grad_MN.astype(x_MK.dtype)
    dx_MK = _matmul(grad_MN, w_KN.T, recipe, recipe.grad_dtype, x_MK.dtype)
    dw_KN = lax.dot_general(x_MK, grad_MN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx_MK, dw_KN.astype(w_KN.dtype)


_dot_fp8.defvjp(_dot_fp8_fwd, _dot_fp8_bwd)


def dot_fp8(x: jax.Array, w_KN: jax.Array, recipe: Recipe) -> jax.Array:
    """x[..., K] @ w[K, N] with FP8 operands in x's dtype (w is cast to x's dtype first)."""
    if x.shape[-1] != w_KN.shape[0]:
        raise ValueError(f"dot_fp8: x's last dim {x.shape[-1]} must equal w.shape[0] = {w_KN.shape[0]}")
    lead = x.shape[:-1]
    out = _dot_fp8(x.reshape(-1, x.shape[-1]), w_KN.astype(x.dtype), recipe)
    return out.reshape(*lead, w_KN.shape[1])
