"""FP8 grouped GEMM with current scaling: `gmm_fp8`, a custom_vjp beside gmm/tgmm.

Legend: R rows grouped by expert, K contraction, N output columns, E experts.

    out_RN = gmm_fp8(lhs_RK, rhs_EKN, group_sizes_E, recipe)   # ~ gmm(lhs, rhs) with FP8 operands

Steps (forward): 1. quantize lhs in the recipe's activation tiles and rhs in its weight tiles
(e4m3, operands.py), lhs rows past sum(group_sizes) zeroed first (they may hold anything, as
gmm leaves them unwritten: a tensorwise amax must not see them); 2. run the backend's "gmm_fp8"
(backends.py: the Pallas kernel on GPU, the dequantizing float32 oracle on CPU), float32
accumulation, scales applied in the kernel, rows past the groups neither computed nor stored
(unspecified, as gmm/api.py says); 3. cast to the output dtype. Backward: d lhs = gmm_fp8(grad, rhs^T) with grad in the recipe's
grad format and rhs^T requantized in weight tiles of the transposed matrix (so rowwise weights
get per-row scales over N); d rhs = tgmm(lhs, grad) in the inputs' precision (recipe.py says why).
The high-precision operands are the residuals (FP8 saves no activation memory here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax.fp8.operands import quantize_lhs, quantize_rhs
from xmoe_jax.fp8.recipe import Recipe
from xmoe_jax.kernels import backends, tgmm
from xmoe_jax.kernels.gmm.fp8_call import Fp8Gmm
from xmoe_jax.kernels.gmm.xla import live_rows
from xmoe_jax.kernels.validation import check_gmm_args, out_dtype
from xmoe_jax.kernels.vma import match_vma

_PROMOTE_EVERY = Recipe().imprecise_acc  # the default recipe's float32 promotion (recipe.py)


def gmm_fp8_quantized(
    lhs_q_RK, lhs_s_RB, rhs_q_EKN, rhs_s_EBN, group_sizes_E, *, block_k, out_dt, impl=None, tile=None,
    imprecise_acc=_PROMOTE_EVERY, zero_unwritten=False,
):  # fmt: skip
    """Run one FP8 grouped GEMM on already-quantized operands (operands.py layouts); not differentiable."""
    call = Fp8Gmm(
        lhs_q_RK, lhs_s_RB, rhs_q_EKN, rhs_s_EBN, group_sizes_E, out_dt, block_k, imprecise_acc,
        zero_unwritten=zero_unwritten,
    )  # fmt: skip
    arrays = (lhs_q_RK, rhs_q_EKN, call.out_shape)
    backend = backends.choose_backend(
        impl, backends.Call("gmm_fp8", arrays, lhs_q_RK.shape[1], rhs_q_EKN.shape[2], tile, block_k)
    )
    return backend.gmm_fp8(call, tile=tile)


def _forward(lhs_RK, rhs_EKN, group_sizes_E, recipe, lhs_dtype, impl, out_dt, tile, zero_unwritten=False):
    # rows past sum(group_sizes) may hold anything (gmm leaves them unwritten): zeroed before the
    # quantize, so a tensorwise amax sees the live rows only (the select fuses into the amax)
    live_R = live_rows(group_sizes_E, lhs_RK.shape[0])
    lhs_q, lhs_s = quantize_lhs(jnp.where(live_R[:, None], lhs_RK, 0), recipe, lhs_dtype)
    rhs_q, rhs_s = quantize_rhs(rhs_EKN, recipe, recipe.act_dtype)
    block_k = recipe.block_k if lhs_s.shape[1] > 1 else 0
    return gmm_fp8_quantized(
        lhs_q, lhs_s, rhs_q, rhs_s, group_sizes_E, block_k=block_k, out_dt=out_dt, impl=impl, tile=tile,
        imprecise_acc=recipe.imprecise_acc, zero_unwritten=zero_unwritten,
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _gmm_fp8(lhs_RK, rhs_EKN, group_sizes_E, recipe, impl, out_dt, tile, zero_unwritten):
    return _forward(
        lhs_RK, rhs_EKN, group_sizes_E, recipe, recipe.act_dtype, impl, out_dt, tile, zero_unwritten
    )


def _gmm_fp8_fwd(lhs_RK, rhs_EKN, group_sizes_E, recipe, impl, out_dt, tile, zero_unwritten):
    out = _forward(
        lhs_RK, rhs_EKN, group_sizes_E, recipe, recipe.act_dtype, impl, out_dt, tile, zero_unwritten
    )
    return out, (lhs_RK, rhs_EKN, group_sizes_E)


def _gmm_fp8_bwd(recipe, impl, out_dt, tile, zero_unwritten, res, grad_RN):
    lhs_RK, rhs_EKN, group_sizes_E = res
    grad_RN = grad_RN.astype(lhs_RK.dtype)
    rhs_ENK = jnp.swapaxes(rhs_EKN, 1, 2)
    dlhs_RK = _forward(  # exact zeros in the rows past sum(group_sizes): they took no part
        grad_RN,
        rhs_ENK,
        group_sizes_E,
        recipe,
        recipe.grad_dtype,
        impl,
        lhs_RK.dtype,
        tile,
        zero_unwritten=True,
    )
    drhs_EKN = tgmm(lhs_RK, grad_RN, group_sizes_E, implementation=impl, preferred_element_type=rhs_EKN.dtype)
    return dlhs_RK, drhs_EKN, None


_gmm_fp8.defvjp(_gmm_fp8_fwd, _gmm_fp8_bwd)


def gmm_fp8(
    lhs_RK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    recipe: Recipe,
    *,
    implementation: str | None = None,
    preferred_element_type=None,
    tile: tuple[int, int, int] | None = None,
    zero_unwritten: bool = False,
) -> jax.Array:
    """Grouped matmul with FP8 operands: out[r] ~ lhs[r] @ rhs[group(r)]; [R, N] in lhs's dtype.

    Arguments as `xmoe_jax.kernels.gmm` (bf16/f16/f32 inputs of one dtype), plus the `recipe`
    (recipe.py) that says how they are scaled and quantized. `implementation` picks the
    backend of the "gmm_fp8" op (None: the platform's default; unavailable ones fall back to
    the xla oracle with a warning that says why). Rows past sum(group_sizes) do not take part
    in the scales and come out unspecified (zeros with `zero_unwritten`). Differentiable in lhs
    and rhs.
    """
    check_gmm_args(lhs_RK, rhs_EKN, group_sizes_E)
    out_dt = out_dtype(lhs_RK.dtype, preferred_element_type)
    backends.check_name(implementation)
    tile = None if tile is None else tuple(int(t) for t in tile)
    lhs_RK, rhs_EKN = match_vma(lhs_RK, rhs_EKN)
    return _gmm_fp8(
        lhs_RK, rhs_EKN, group_sizes_E, recipe, implementation, out_dt, tile, bool(zero_unwritten)
    )
