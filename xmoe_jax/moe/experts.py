"""Expert MLPs: routed experts batched over E, and the fused shared expert.

Shapes: E experts, C rows per expert, D model, F expert hidden, T tokens.
SwiGLU: down(silu(x @ gate) * (x @ up)); GELU (the X-MoE paper's 2-matrix expert):
down(gelu(x @ up)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.fp8 import dot_fp8, gmm_fp8
from xmoe_jax.kernels import combine, gmm, permute, tgmm
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
    """The shared experts (fused into one MLP), optionally scaled by sigmoid(x @ gate).
    Named `shared_experts` in profiles and HLO metadata."""
    with jax.named_scope("shared_experts"):
        y_TD = dense_mlp(x_TD, shared, activation)
        if "gate" in shared:
            g_T1 = jax.nn.sigmoid(x_TD.astype(jnp.float32) @ shared["gate"].astype(jnp.float32))
            y_TD = (y_TD.astype(jnp.float32) * g_T1).astype(x_TD.dtype)
    return y_TD


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute_up(x_TD, dest_TK, num_rows: int, w_up: tuple, group_sizes_E):
    """The expert input rows x_RD = permute(x_TD, dest_TK) through each up-projection matrix (cast to
    the rows' dtype); returns one [R, F] hidden per matrix.

    The backward pass keeps x_TD (T rows, which the caller keeps anyway) instead of the K-times
    larger x_RD, and the weights as passed (the float32 masters) instead of their cast copies, and
    recomputes both: a gather and a cast against the grouped GEMMs they feed."""
    x_RD = permute(x_TD, dest_TK, num_rows)
    return tuple(gmm(x_RD, w.astype(x_RD.dtype), group_sizes_E) for w in w_up)


def _permute_up_fwd(x_TD, dest_TK, num_rows, w_up, group_sizes_E):
    return _permute_up(x_TD, dest_TK, num_rows, w_up, group_sizes_E), (x_TD, dest_TK, w_up, group_sizes_E)


def _permute_up_bwd(num_rows, res, d_hidden):
    x_TD, dest_TK, w_up, group_sizes_E = res
    x_RD, permute_vjp = jax.vjp(lambda x: permute(x, dest_TK, num_rows), x_TD)
    d_hidden = [d.astype(x_RD.dtype) for d in d_hidden]
    dx_RD = sum(
        gmm(d, w.astype(x_RD.dtype), group_sizes_E, transpose_rhs=True)
        for d, w in zip(d_hidden, w_up, strict=True)
    )
    dw = tuple(tgmm(x_RD, d, group_sizes_E).astype(w.dtype) for d, w in zip(d_hidden, w_up, strict=True))
    (dx_TD,) = permute_vjp(dx_RD)
    return dx_TD, None, dw, None


_permute_up.defvjp(_permute_up_fwd, _permute_up_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _act_down(hidden, w_EFD, group_sizes_E, activation: str):
    """gmm(act(hidden), w cast to the hidden dtype). The backward keeps the pre-activation hidden
    (one [R, F] per input matrix) and the master w, and recomputes the activation (elementwise) and
    the cast: autodiff would keep the activation's output and intermediates beside its input."""
    act_RF = _act(*hidden, activation)
    return gmm(act_RF, w_EFD.astype(act_RF.dtype), group_sizes_E)


def _act_down_fwd(hidden, w_EFD, group_sizes_E, activation):
    return _act_down(hidden, w_EFD, group_sizes_E, activation), (hidden, w_EFD, group_sizes_E)


def _act_down_bwd(activation, res, d_RD):
    hidden, w_EFD, group_sizes_E = res
    act_RF, act_vjp = jax.vjp(lambda *h: _act(*h, activation), *hidden)
    d_RD = d_RD.astype(act_RF.dtype)
    w = w_EFD.astype(act_RF.dtype)
    d_act_RF = gmm(d_RD, w, group_sizes_E, transpose_rhs=True)
    dw_EFD = tgmm(act_RF, d_RD, group_sizes_E).astype(w_EFD.dtype)
    return act_vjp(d_act_RF), dw_EFD, None


_act_down.defvjp(_act_down_fwd, _act_down_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _act_down_combine(hidden, w_EFD, group_sizes_E, dest_TK, weights_TK, activation: str):
    """combine(gmm(act(hidden), w), dest_TK, weights_TK): the experts' outputs weighted back into their
    tokens, [T, D] in float32, when the rows never leave the device (no exchange in between).

    The backward pass keeps no [R, D] output: the combine weight's gradient <dy_t, out_r> equals
    <dy_t W^T, act_r>, and dy_t W^T (a grouped GEMM of the unweighted rows) is the activation's
    gradient before the weight; so it keeps what `_act_down` keeps and the [T, K] dest and weights."""
    act_RF = _act(*hidden, activation)
    out_RD = gmm(act_RF, w_EFD.astype(act_RF.dtype), group_sizes_E)
    return combine(out_RD, dest_TK, weights_TK)


def _act_down_combine_fwd(hidden, w_EFD, group_sizes_E, dest_TK, weights_TK, activation):
    y_TD = _act_down_combine(hidden, w_EFD, group_sizes_E, dest_TK, weights_TK, activation)
    return y_TD, (hidden, w_EFD, group_sizes_E, dest_TK, weights_TK)


def _act_down_combine_bwd(activation, res, dy_TD):
    hidden, w_EFD, group_sizes_E, dest_TK, weights_TK = res
    act_RF, act_vjp = jax.vjp(lambda *h: _act(*h, activation), *hidden)
    num_rows, dt = act_RF.shape[0], act_RF.dtype
    dy_RD = permute(dy_TD.astype(dt), dest_TK, num_rows)  # row r holds dy of its token, unweighted
    u_RF = gmm(dy_RD, w_EFD.astype(dt), group_sizes_E, transpose_rhs=True)  # dy_t W^T per row
    rows_A = dest_TK.reshape(-1)
    g_R = jnp.zeros((num_rows,), jnp.float32).at[rows_A].set(weights_TK.reshape(-1), mode="drop")
    s_R = jnp.sum(u_RF.astype(jnp.float32) * act_RF.astype(jnp.float32), axis=-1)
    dweights_TK = s_R.at[rows_A].get(mode="fill", fill_value=0.0).reshape(weights_TK.shape)
    d_act_RF = (u_RF.astype(jnp.float32) * g_R[:, None]).astype(dt)
    dw_EFD = tgmm((act_RF.astype(jnp.float32) * g_R[:, None]).astype(dt), dy_RD, group_sizes_E)
    return act_vjp(d_act_RF), dw_EFD.astype(w_EFD.dtype), None, None, dweights_TK.astype(weights_TK.dtype)


_act_down_combine.defvjp(_act_down_combine_fwd, _act_down_combine_bwd)


def _fp8_experts(x_RD, experts: dict, gs_E, activation: str, recipe) -> jax.Array:
    """The experts as FP8 grouped GEMMs (fp8/gmm.py: their own custom VJP and what it keeps)."""

    def mm(x, w):
        return gmm_fp8(x, w.astype(x_RD.dtype), gs_E, recipe)

    h_up = tag(mm(x_RD, experts["w_up"]), EXPERT_HIDDEN)
    h_gate = tag(mm(x_RD, experts["w_gate"]), EXPERT_HIDDEN) if activation == "swiglu" else None
    return mm(_act(h_gate, h_up, activation), experts["w_down"])


def _hidden(x_TD, dest_TK, num_rows, experts, gs_E, activation) -> tuple:
    names = ("w_gate", "w_up") if activation == "swiglu" else ("w_up",)
    hidden = _permute_up(x_TD, dest_TK, int(num_rows), tuple(experts[n] for n in names), gs_E)
    hidden = tuple(tag(h, EXPERT_HIDDEN) for h in hidden)
    return hidden if activation == "swiglu" else (None, *hidden)


def combined_experts(
    x_TD: jax.Array,
    dest_TK: jax.Array,
    num_rows: int,
    experts: dict,
    group_sizes_E: jax.Array,
    activation: str,
    weights_TK: jax.Array,
) -> jax.Array:
    """`combine(grouped_experts(...), dest_TK, weights_TK)` in one piece, for rows that stay on their
    device: [T, D] float32. Keeps x_TD, the pre-activation hidden and the [T, K] routing for the
    backward pass (`_act_down_combine`), not the [R, D] rows or outputs."""
    gs_E = group_sizes_E.astype(jnp.int32)
    recipe = fp8_context.recipe_for("experts")
    with jax.named_scope("experts"):  # the name profiles and HLO metadata show
        if recipe is not None:
            out_RD = _fp8_experts(permute(x_TD, dest_TK, num_rows), experts, gs_E, activation, recipe)
            return tag(combine(out_RD, dest_TK, weights_TK), EXPERT_OUT)
        hidden = _hidden(x_TD, dest_TK, num_rows, experts, gs_E, activation)
        y_TD = _act_down_combine(hidden, experts["w_down"], gs_E, dest_TK, weights_TK, activation)
    return tag(y_TD, EXPERT_OUT)


def grouped_experts(
    x_TD: jax.Array,
    dest_TK: jax.Array,
    num_rows: int,
    experts: dict,
    group_sizes_E: jax.Array,
    activation: str,
) -> jax.Array:
    """Experts over a flat expert-major buffer: rows of group e go through expert e; [R, D].

    The rows are `permute(x_TD, dest_TK, num_rows)` (kernels.permute: row dest[t, k] holds x[t];
    a [R, 1] dest of row indices gathers a buffer into a new order). Rows past
    sum(group_sizes_E) give zero. Grouped GEMMs through `xmoe_jax.kernels.gmm` (the Pallas kernel
    on GPU, `ragged_dot` on CPU), whose backward passes are grouped GEMMs too. What the backward
    pass keeps: x_TD and the pre-activation hidden; the permuted rows, the activation and the
    weights' compute-dtype copies are recomputed (`_permute_up`, `_act_down`). FP8 grouped GEMMs
    (fp8/gmm.py) when the FP8 policy covers the experts.
    """
    gs_E = group_sizes_E.astype(jnp.int32)
    recipe = fp8_context.recipe_for("experts")
    with jax.named_scope("experts"):  # the name profiles and HLO metadata show
        if recipe is not None:
            y_RD = _fp8_experts(permute(x_TD, dest_TK, num_rows), experts, gs_E, activation, recipe)
        else:
            hidden = _hidden(x_TD, dest_TK, num_rows, experts, gs_E, activation)
            y_RD = _act_down(hidden, experts["w_down"], gs_E, activation)
    return tag(y_RD, EXPERT_OUT)
