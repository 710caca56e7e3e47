"""Expert MLPs: routed experts batched over E, and the fused shared expert.

Shapes: E experts, C rows per expert, D model, F expert hidden, T tokens.
SwiGLU: down(silu(x @ gate) * (x @ up)); GELU (the X-MoE paper's 2-matrix expert):
down(gelu(x @ up)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.fp8 import dot_fp8, gmm_fp8
from xmoe_jax.kernels import gmm
from xmoe_jax.remat import EXPERT_HIDDEN, EXPERT_OUT, tag


def _act(h_gate, h_up, activation: str):
    if activation == "swiglu":
        return jax.nn.silu(h_gate) * h_up
    return jax.nn.gelu(h_up)


def batched_experts(x_ECD: jax.Array, experts: dict, activation: str) -> jax.Array:
    """Each expert e applied to its own rows x_ECD[e]; compute in x's dtype."""
    dtype = x_ECD.dtype
    h_up = tag(jnp.einsum("ecd,edf->ecf", x_ECD, experts["w_up"].astype(dtype)), EXPERT_HIDDEN)
    h_gate = None
    if activation == "swiglu":
        h_gate = tag(jnp.einsum("ecd,edf->ecf", x_ECD, experts["w_gate"].astype(dtype)), EXPERT_HIDDEN)
    out_ECD = jnp.einsum("ecf,efd->ecd", _act(h_gate, h_up, activation), experts["w_down"].astype(dtype))
    return tag(out_ECD, EXPERT_OUT)


def dense_mlp(x_TD: jax.Array, mlp: dict, activation: str) -> jax.Array:
    """A plain MLP (dense layers and the shared expert); params w_[gate,up] [D,F], w_down [F,D].
    FP8 GEMMs (fp8/dense.py) when the FP8 policy covers projections."""
    dtype, recipe = x_TD.dtype, fp8_context.recipe_for("projections")

    def mm(x, w):
        return x @ w.astype(dtype) if recipe is None else dot_fp8(x, w, recipe)

    h_up = mm(x_TD, mlp["w_up"])
    h_gate = mm(x_TD, mlp["w_gate"]) if activation == "swiglu" else None
    return mm(_act(h_gate, h_up, activation), mlp["w_down"])


def shared_experts(x_TD: jax.Array, shared: dict, activation: str) -> jax.Array:
    """The shared experts (fused into one MLP), optionally scaled by sigmoid(x @ gate)."""
    y_TD = dense_mlp(x_TD, shared, activation)
    if "gate" in shared:
        g_T1 = jax.nn.sigmoid(x_TD.astype(jnp.float32) @ shared["gate"].astype(jnp.float32))
        y_TD = (y_TD.astype(jnp.float32) * g_T1).astype(x_TD.dtype)
    return y_TD


def grouped_experts(x_RD: jax.Array, experts: dict, group_sizes_E: jax.Array, activation: str) -> jax.Array:
    """Experts over a flat expert-major buffer: rows of group e go through expert e.

    Rows past sum(group_sizes_E) give zero. Grouped GEMMs through `xmoe_jax.kernels.gmm`
    (the Pallas kernel on GPU, `ragged_dot` on CPU), whose backward passes are grouped
    GEMMs too; FP8 grouped GEMMs (fp8/gmm.py) when the FP8 policy covers the experts.
    """
    dtype, recipe = x_RD.dtype, fp8_context.recipe_for("experts")
    gs_E = group_sizes_E.astype(jnp.int32)

    def mm(x, w):
        w = w.astype(dtype)
        return gmm(x, w, gs_E) if recipe is None else gmm_fp8(x, w, gs_E, recipe)

    h_up = tag(mm(x_RD, experts["w_up"]), EXPERT_HIDDEN)
    h_gate = tag(mm(x_RD, experts["w_gate"]), EXPERT_HIDDEN) if activation == "swiglu" else None
    return tag(mm(_act(h_gate, h_up, activation), experts["w_down"]), EXPERT_OUT)
