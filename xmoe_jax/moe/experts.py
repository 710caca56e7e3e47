"""Expert MLPs: routed experts batched over E, and the fused shared expert.

Shapes: E experts, C rows per expert, D model, F expert hidden, T tokens, K top-k, R grouped rows
(grouped by expert), M received rows (arrival order).
SwiGLU: down(silu(x @ gate) * (x @ up)); GELU (the X-MoE paper's 2-matrix expert):
down(gelu(x @ up)).

The routed experts never copy their rows into expert order: the grouped GEMMs (kernels.gmm) read
rows through an index on load and write them through an index on store.
  combined_experts  (one device: tokens -> experts -> tokens) reads x_TD through `token_rows`
                    (a token's K copies read its row K times) and combines the outputs with the
                    routing weights; d x sums each token's K rows with `combine`.
  arrival_experts   (after an exchange: received rows, each read once) reads x_MD through the
                    grouped -> arrival index and stores each output at its arrival row; d x is
                    stored back through the same index. Rows that arrived grouped by expert
                    (no index) are read and written in place.
  pushed_experts    (a transport that lands rows grouped by expert and has a `gmm_move`: push) the
                    exchange and the same experts, whose GEMMs also run the exchanges back to the
                    sources: the forward's return inside the down-projection, the backward's d x
                    inside the up-projections' data-gradient GEMM (push: under the GEMM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.fp8 import dot_fp8, gmm_fp8
from xmoe_jax.kernels import combine, gmm, permute, shared_rows, tgmm, token_rows
from xmoe_jax.kernels.act_grad import act_grad
from xmoe_jax.moe.exchange import no_cotangent
from xmoe_jax.remat import EXCHANGE_IN, EXPERT_HIDDEN, EXPERT_OUT, tag

if TYPE_CHECKING:
    from xmoe_jax.moe.transports import Transport


def _act(h_gate, h_up, activation: str):
    """silu(gate) * up or gelu(up) (tanh form), in up's dtype. The combine's backward evaluates it
    in float32 (act_grad); written here in float32 too, the unweighted arrival paths' autodiff of it
    held 11 MB more temporaries on the remat test's tiny model (tests/test_scale.py), so it stays
    jax.nn's."""
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


def _up_bwd_operands(d_hidden, w_up, dtype):
    """The up-projections' gradients as one GEMM: d hidden [R, n*F] and the weights [E, D, n*F],
    concatenated along F (SwiGLU's gate and up), so d x is one grouped GEMM, not two and a sum."""
    d_RF = jnp.concatenate([d.astype(dtype) for d in d_hidden], axis=1)
    w_EDF = jnp.concatenate([w.astype(dtype) for w in w_up], axis=2)
    return d_RF, w_EDF


def _split_dw(dw_EDF, w_up) -> tuple:
    """Split the concatenated weight gradient back per matrix, in each master's dtype."""
    ends = np.cumsum([w.shape[2] for w in w_up])
    return tuple(dw_EDF[:, :, e - w.shape[2] : e].astype(w.dtype) for e, w in zip(ends, w_up, strict=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute_up(x_TD, dest_TK, num_rows: int, w_up: tuple, group_sizes_E):
    """The expert input rows x_RD = permute(x_TD, dest_TK) through each up-projection matrix (cast to
    the rows' dtype); returns one [R, F] hidden per matrix (rows past sum(group_sizes) unspecified).

    No x_RD is made: the grouped GEMMs read token rows through `token_rows` (gather on load). The
    backward pass keeps x_TD and the weights as passed (the float32 masters), recomputing their
    casts; d x is one grouped GEMM of the concatenated gradients into grouped order, summed over
    each token's K rows by `combine` (a token-centric gather-sum: no atomics)."""
    tok_R = token_rows(dest_TK, x_TD.shape[0], num_rows)
    return tuple(
        gmm(x_TD, w.astype(x_TD.dtype), group_sizes_E, lhs_rows_R=tok_R, zero_unwritten=False) for w in w_up
    )


def _permute_up_fwd(x_TD, dest_TK, num_rows, w_up, group_sizes_E):
    out = _permute_up(x_TD, dest_TK, num_rows, w_up, group_sizes_E)
    return out, (x_TD, dest_TK, w_up, group_sizes_E)


def _permute_up_bwd(num_rows, res, d_hidden):
    x_TD, dest_TK, w_up, group_sizes_E = res
    tok_R = token_rows(dest_TK, x_TD.shape[0], num_rows)
    d_RF, w_EDF = _up_bwd_operands(d_hidden, w_up, x_TD.dtype)
    dx_RD = gmm(d_RF, w_EDF, group_sizes_E, transpose_rhs=True, zero_unwritten=False)
    dw = _split_dw(tgmm(x_TD, d_RF, group_sizes_E, lhs_rows_R=tok_R), w_up)
    dx_TD = combine(dx_RD, dest_TK, jnp.ones(dest_TK.shape, jnp.float32)).astype(x_TD.dtype)
    return dx_TD, None, dw, None


_permute_up.defvjp(_permute_up_fwd, _permute_up_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gather_up(x_MD, arrival_R, w_up: tuple, group_sizes_E, num_rows: int):
    """Each up-projection of the rows x_MD[arrival_R[r]] (gather on load, no grouped copy of x_MD;
    arrival_R None: x_MD is grouped already); [R, F] per matrix, rows past sum(group_sizes)
    unspecified. Every x_MD row is read at most once, so d x is one grouped GEMM scattered straight
    back into x_MD's rows (zeros in the rows nobody reads). Keeps x_MD and the master weights, as
    `_permute_up` does."""
    del num_rows
    return tuple(
        gmm(x_MD, w.astype(x_MD.dtype), group_sizes_E, lhs_rows_R=arrival_R, zero_unwritten=False)
        for w in w_up
    )


def _gather_up_fwd(x_MD, arrival_R, w_up, group_sizes_E, num_rows):
    return _gather_up(x_MD, arrival_R, w_up, group_sizes_E, num_rows), (x_MD, arrival_R, w_up, group_sizes_E)


def _gather_up_bwd(num_rows, res, d_hidden):
    x_MD, arrival_R, w_up, group_sizes_E = res
    d_RF, w_EDF = _up_bwd_operands(d_hidden, w_up, x_MD.dtype)
    dx_MD = gmm(
        d_RF, w_EDF, group_sizes_E, transpose_rhs=True, zero_unwritten=True, **_stored_at(arrival_R, x_MD.shape[0])
    )  # fmt: skip
    dw = _split_dw(tgmm(x_MD, d_RF, group_sizes_E, lhs_rows_R=arrival_R), w_up)
    return dx_MD, None, dw, None


_gather_up.defvjp(_gather_up_fwd, _gather_up_bwd)


def _stored_at(arrival_R, num_out: int) -> dict:
    """gmm's scatter-on-store arguments: grouped row r stored at arrival_R[r] of num_out rows, or
    none (arrival_R None: the output is grouped, like the rows that arrived grouped)."""
    return {} if arrival_R is None else {"out_rows_R": arrival_R, "num_out_rows": num_out}


def _weighted(act_RF, g_R):
    """act * g per row (the routing weight folded in before the down-projection), in act's dtype."""
    return act_RF if g_R is None else (act_RF.astype(jnp.float32) * g_R[:, None]).astype(act_RF.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _act_down_scatter(hidden, w_EFD, group_sizes_E, arrival_R, g_R, num_out: int, activation: str):
    """gmm(act(hidden) * g_R, w) with grouped row r stored at row arrival_R[r] of a [num_out, D] output
    (scatter on store: no grouped copy to put back in order); g_R None: unweighted. Output rows no
    grouped row writes are unspecified. The backward keeps the pre-activation hidden (one [R, F] per
    input matrix), the master w and g, and recomputes the activation (elementwise) and the cast:
    autodiff would keep the activation's output and intermediates beside its input. It gathers the
    output's cotangent rows through the same index (d act and d w read them in place)."""
    act_RF = _weighted(_act(*hidden, activation), g_R)
    w = w_EFD.astype(act_RF.dtype)
    return gmm(act_RF, w, group_sizes_E, zero_unwritten=False, **_stored_at(arrival_R, num_out))


def _act_down_scatter_fwd(hidden, w_EFD, group_sizes_E, arrival_R, g_R, num_out, activation):
    y_MD = _act_down_scatter(hidden, w_EFD, group_sizes_E, arrival_R, g_R, num_out, activation)
    return y_MD, (hidden, w_EFD, group_sizes_E, arrival_R, g_R)


def _act_down_scatter_bwd(num_out, activation, res, d_MD):
    hidden, w_EFD, group_sizes_E, arrival_R, g_R = res
    d_hidden, dw_EFD, dg_R = _act_down_bwd(hidden, w_EFD, group_sizes_E, arrival_R, d_MD, activation, g_R=g_R)
    return d_hidden, dw_EFD, None, None, dg_R


_act_down_scatter.defvjp(_act_down_scatter_fwd, _act_down_scatter_bwd)


def _tied(hidden: tuple, cotangent) -> tuple:
    """(hidden, cotangent) through one optimization barrier, for a backward pass that recomputes the
    activation from hidden: otherwise XLA merges that activation with the forward's (the same op on the
    same operands: CSE) and keeps the forward's act and its tanh live until the backward reads them
    back, two [R, F] arrays per layer written, stored and read again (benchmarks/train_step.md)."""
    *hidden, cotangent = jax.lax.optimization_barrier((*hidden, cotangent))
    return tuple(hidden), cotangent


def _recomputed_act(hidden: tuple, cotangent, activation: str):
    """(act(hidden), its vjp, cotangent) in a backward pass, the activation computed afresh there (`_tied`)."""
    hidden, cotangent = _tied(hidden, cotangent)
    act_RF, act_vjp = jax.vjp(lambda *h: _act(*h, activation), *hidden)
    return act_RF, act_vjp, cotangent


def _act_down_bwd(hidden, w_EFD, group_sizes_E, arrival_R, d_MD, activation: str, d_act_RF=None, g_R=None):
    """The down-projection's backward (act and cast recomputed): d hidden per matrix, d w and d g (None
    without row weights g_R). `d_act_RF`: d y W^T when the exchange's kernel computed it already
    (transports.arrive_gmm). With g_R, one pass over the rows (act_grad) gives d hidden, act * g (d w's
    operand) and d g = <d y W^T, act>; the one-device combine's backward (`_act_down_combine`) runs it too."""
    if g_R is None:
        act_RF, act_vjp, d_MD = _recomputed_act(hidden, d_MD, activation)
        dt = act_RF.dtype
    else:
        hidden, d_MD = _tied(hidden, d_MD)
        dt = hidden[1].dtype
    d_MD = d_MD.astype(dt)
    if d_act_RF is None:
        d_MD, arrival_R = shared_rows(d_MD, arrival_R)  # one gather for both GEMMs where XLA gathers
        w = w_EFD.astype(dt)
        d_act_RF = gmm(d_MD, w, group_sizes_E, transpose_rhs=True, lhs_rows_R=arrival_R, zero_unwritten=False)
    if g_R is None:
        dw_EFD = tgmm(act_RF, d_MD, group_sizes_E, grad_rows_R=arrival_R).astype(w_EFD.dtype)
        return act_vjp(d_act_RF), dw_EFD, None
    d_hidden, wact_RF, s_R = act_grad(hidden, d_act_RF, g_R, activation)
    dw_EFD = tgmm(wact_RF, d_MD, group_sizes_E, grad_rows_R=arrival_R).astype(w_EFD.dtype)
    # rows past sum(group_sizes) hold no row: their s is unspecified, their weight's gradient 0
    live_R = jnp.arange(s_R.shape[0]) < jnp.sum(group_sizes_E)
    return d_hidden, dw_EFD, jnp.where(live_R, s_R, 0.0).astype(g_R.dtype)


class Return(NamedTuple):
    """The exchanges `pushed_experts` runs (static): the send buffer's rows, the receive
    buffer's rows, the axis, the transport (its `gmm_move`) and the most rows one update moves."""

    send_rows: int
    recv_rows: int
    axis_name: str
    transport: Transport
    max_piece: int
    # the exchanges that bring rows here, each with the GEMM after it in one kernel
    # (transports.arrive_gmm: push's arrive prologue), or None: the exchange, then the GEMM
    arrive: Callable | None = None
    # with `arrive`: keep the expert hidden for the backward (the block's remat policy keeps it:
    # remat.keeps) or recompute it there from the kept received rows (`_arrived`)
    keep_hidden: bool = True


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _act_down_return(hidden, w_EFD, group_sizes_E, plan, g_R, ret: Return, activation: str):
    """exchange(gmm(act(hidden) * g_R, w), plan.reverse()) with the exchange inside the GEMM's kernel
    (`ret.transport.gmm_move`): [send_rows, D], each output row back in its source's send buffer.
    The backward moves the cotangent forward (the dispatch's direction) into the grouped rows, then
    runs the down-projection's backward (`_act_down_bwd`); it keeps what `_act_down_scatter` keeps,
    and the plan."""
    act_RF = _weighted(_act(*hidden, activation), g_R)
    w = w_EFD.astype(act_RF.dtype)
    move = ret.transport.gmm_move
    return move(act_RF, w, group_sizes_E, plan.reverse(), ret.send_rows, ret.axis_name, ret.max_piece)


def _act_down_return_fwd(hidden, w_EFD, group_sizes_E, plan, g_R, ret, activation):
    y_AD = _act_down_return(hidden, w_EFD, group_sizes_E, plan, g_R, ret, activation)
    return y_AD, (hidden, w_EFD, group_sizes_E, plan, g_R)


def _act_down_return_bwd(ret, activation, res, d_AD):
    hidden, w_EFD, group_sizes_E, plan, g_R = res
    d_MD = ret.transport.move(d_AD, plan, ret.recv_rows, ret.axis_name, ret.max_piece)
    d_hidden, dw_EFD, dg_R = _act_down_bwd(hidden, w_EFD, group_sizes_E, None, d_MD, activation, g_R=g_R)
    return d_hidden, dw_EFD, None, no_cotangent(plan), dg_R


_act_down_return.defvjp(_act_down_return_fwd, _act_down_return_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _act_down_combine(hidden, w_EFD, group_sizes_E, dest_TK, weights_TK, activation: str):
    """combine(gmm(act(hidden), w), dest_TK, weights_TK): the experts' outputs weighted back into their
    tokens, [T, D] in float32, when the rows never leave the device (no exchange in between).

    The backward pass keeps no [R, D] output: the combine weight's gradient <dy_t, out_r> equals
    <dy_t W^T, act_r>, and dy_t W^T (a grouped GEMM of the unweighted rows, read from dy_TD through
    `token_rows`: no permuted copy) is the activation's gradient before the weight; so it keeps
    what `_act_down_scatter` keeps and the [T, K] dest and weights."""
    act_RF = _act(*hidden, activation)
    out_RD = gmm(act_RF, w_EFD.astype(act_RF.dtype), group_sizes_E, zero_unwritten=False)
    return combine(out_RD, dest_TK, weights_TK)


def _act_down_combine_fwd(hidden, w_EFD, group_sizes_E, dest_TK, weights_TK, activation):
    y_TD = _act_down_combine(hidden, w_EFD, group_sizes_E, dest_TK, weights_TK, activation)
    return y_TD, (hidden, w_EFD, group_sizes_E, dest_TK, weights_TK)


def _act_down_combine_bwd(activation, res, dy_TD):
    hidden, w_EFD, group_sizes_E, dest_TK, weights_TK = res
    num_rows = hidden[1].shape[0]
    tok_R = token_rows(dest_TK, dy_TD.shape[0], num_rows)  # row r reads dy of its token, unweighted
    rows_A = dest_TK.reshape(-1)
    g_R = jnp.zeros((num_rows,), jnp.float32).at[rows_A].set(weights_TK.reshape(-1), mode="drop")
    d_hidden, dw_EFD, s_R = _act_down_bwd(hidden, w_EFD, group_sizes_E, tok_R, dy_TD, activation, g_R=g_R)
    dweights_TK = s_R.at[rows_A].get(mode="fill", fill_value=0.0).reshape(weights_TK.shape)
    return d_hidden, dw_EFD, None, None, dweights_TK.astype(weights_TK.dtype)


_act_down_combine.defvjp(_act_down_combine_fwd, _act_down_combine_bwd)


def _fp8_experts(x_RD, experts: dict, gs_E, activation: str, recipe, g_R=None) -> jax.Array:
    """The experts as FP8 grouped GEMMs (fp8/gmm.py: their own custom VJP and what it keeps); g_R: each
    row's routing weight, folded into the activation (autodiff's d g reads act, not the output)."""

    def mm(x, w):
        return gmm_fp8(x, w.astype(x_RD.dtype), gs_E, recipe)

    h_up = tag(mm(x_RD, experts["w_up"]), EXPERT_HIDDEN)
    h_gate = tag(mm(x_RD, experts["w_gate"]), EXPERT_HIDDEN) if activation == "swiglu" else None
    return mm(_weighted(_act(h_gate, h_up, activation), g_R), experts["w_down"])


def _up_names(activation: str) -> tuple[str, ...]:
    return ("w_gate", "w_up") if activation == "swiglu" else ("w_up",)


def _tag_hidden(hidden: tuple, activation: str) -> tuple:
    hidden = tuple(tag(h, EXPERT_HIDDEN) for h in hidden)
    return hidden if activation == "swiglu" else (None, *hidden)


def _hidden(x_TD, dest_TK, num_rows, experts, gs_E, activation) -> tuple:
    w_up = tuple(experts[n] for n in _up_names(activation))
    return _tag_hidden(_permute_up(x_TD, dest_TK, int(num_rows), w_up, gs_E), activation)


def combined_experts(
    x_TD: jax.Array,
    dest_TK: jax.Array,
    num_rows: int,
    experts: dict,
    group_sizes_E: jax.Array,
    activation: str,
    weights_TK: jax.Array,
) -> jax.Array:
    """`combine(experts over permute(x_TD, dest_TK, num_rows), dest_TK, weights_TK)` in one piece, for
    rows that stay on their device: [T, D] float32. The up-projections read token rows through the
    inverse of dest_TK (`token_rows`: gather on load), so no [R, D] copy of the tokens exists in
    either pass. Keeps x_TD, the pre-activation hidden and the [T, K] routing for the backward pass
    (`_permute_up`, `_act_down_combine`), not the [R, D] rows or outputs. FP8 (fp8/gmm.py) keeps
    the materialised permute: its kernel has the same loads (schedule.py) but its quantize-and-
    scale API takes no row index yet."""
    gs_E = group_sizes_E.astype(jnp.int32)
    recipe = fp8_context.recipe_for("experts")
    with jax.named_scope("experts"):  # the name profiles and HLO metadata show
        if recipe is not None:
            out_RD = _fp8_experts(permute(x_TD, dest_TK, num_rows), experts, gs_E, activation, recipe)
            return tag(combine(out_RD, dest_TK, weights_TK), EXPERT_OUT)
        hidden = _hidden(x_TD, dest_TK, num_rows, experts, gs_E, activation)
        y_TD = _act_down_combine(hidden, experts["w_down"], gs_E, dest_TK, weights_TK, activation)
    return tag(y_TD, EXPERT_OUT)


def arrival_experts(
    x_MD: jax.Array,
    arrival_R: jax.Array,
    experts: dict,
    group_sizes_E: jax.Array,
    activation: str,
    weights_M: jax.Array | None = None,
) -> jax.Array:
    """Experts over rows that stay where they arrived: grouped row r (grouped by expert, group e
    going through expert e) is x_MD[arrival_R[r]], and its output is stored at row arrival_R[r] of
    the [M, D] result, for r < sum(group_sizes_E). arrival_R None: the rows arrived grouped
    (grouped row r is x_MD[r]). Rows of the result that no grouped row writes are unspecified (the
    reverse exchange does not read them). `weights_M` (float32 [M], one routing weight per arrival
    row, or None): each output row comes out weighted, the weight folded into the activation before
    the down-projection, so the combine after the return is a plain sum that keeps no returned rows
    and the weight's gradient is <d y W_down^T, act> (`_act_down_bwd`).

    Gather on load into the up-projections and scatter on store out of the down-projection
    (kernels.gmm's row indices): no grouped copy of x_MD and no ungrouped copy of the output, in
    either pass. arrival_R must name each row at most once. What the backward pass keeps: x_MD,
    the pre-activation hidden, the index and the rows' weights (`_gather_up`, `_act_down_scatter`).
    FP8 grouped GEMMs (fp8/gmm.py) keep the materialised group / ungroup permutes.
    """
    gs_E = group_sizes_E.astype(jnp.int32)
    num_rows = x_MD.shape[0]
    recipe = fp8_context.recipe_for("experts")
    with jax.named_scope("experts"):  # the name profiles and HLO metadata show
        if recipe is not None and arrival_R is None:  # grouped already; rows past the sum are zeroed
            live_M = jnp.arange(num_rows) < jnp.sum(gs_E)  # (unwritten: no NaN may reach a scale)
            g_M = _row_weights(weights_M, None)
            g_M = None if g_M is None else jnp.where(live_M, g_M, 0.0)
            y_MD = _fp8_experts(jnp.where(live_M[:, None], x_MD, 0), experts, gs_E, activation, recipe, g_M)
        elif recipe is not None:  # group, run the FP8 experts, put back in arrival order
            grouped_M = _grouped_rows(arrival_R, gs_E, num_rows)
            g_R = _row_weights(weights_M, arrival_R)
            y_RD = _fp8_experts(
                permute(x_MD, grouped_M, arrival_R.shape[0]), experts, gs_E, activation, recipe, g_R
            )
            y_MD = combine(y_RD, grouped_M)
        else:
            w_up = tuple(experts[n] for n in _up_names(activation))
            hidden = _tag_hidden(_gather_up(x_MD, arrival_R, w_up, gs_E, num_rows), activation)
            g_R = _row_weights(weights_M, arrival_R)
            y_MD = _act_down_scatter(hidden, experts["w_down"], gs_E, arrival_R, g_R, num_rows, activation)
    return tag(y_MD, EXPERT_OUT)


def _row_weights(weights_M, arrival_R):
    """float32 [R]: each grouped row's routing weight, read through the arrival index (arrival_R None:
    the rows arrived grouped; rows past the received total weigh 0); None without weights."""
    if weights_M is None:
        return None
    weights_M = weights_M.astype(jnp.float32)
    return weights_M if arrival_R is None else weights_M.at[arrival_R].get(mode="fill", fill_value=0.0)


def pushed_experts(
    x_AD: jax.Array,
    experts: dict,
    group_sizes_E: jax.Array,
    activation: str,
    plan,
    ret: Return,
    weights_M: jax.Array | None = None,
) -> jax.Array:
    """exchange(arrival_experts(exchange(x_AD, plan), None, ...), plan.reverse()) for a transport that
    lands rows grouped by local expert and runs a GEMM's output straight back (`ret.transport.gmm_move`):
    [ret.send_rows, D], each output row in its source's send buffer. In both passes, the exchange that
    carries rows back to their sources runs inside the GEMM before it: the forward's return inside the
    down-projection (`_act_down_return`), the backward's d x inside the up-projections' data-gradient
    GEMM (`_arrive_up`); push runs them under the GEMM. Keeps what `arrival_experts` keeps (the
    received rows, tagged EXCHANGE_IN, and the pre-activation hidden), and the plan. `weights_M`: the
    received rows' routing weights, folded in as `arrival_experts` does (the rows arrive grouped, so
    row r's weight is weights_M[r]). Not for FP8 experts (their GEMMs have no such epilogue)."""
    gs_E = group_sizes_E.astype(jnp.int32)
    g_R = _row_weights(weights_M, None)
    with jax.named_scope("experts"):
        w_up = tuple(experts[n] for n in _up_names(activation))
        if ret.arrive is not None:  # the exchanges that bring rows, inside the GEMMs after them too
            return _arrived(x_AD, w_up, experts["w_down"], gs_E, plan, g_R, ret, activation)
        hidden = _tag_hidden(_arrive_up(x_AD, w_up, gs_E, plan, ret), activation)
        return _act_down_return(hidden, experts["w_down"], gs_E, plan, g_R, ret, activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _arrived(x_AD, w_up: tuple, w_EFD, group_sizes_E, plan, g_R, ret: Return, activation: str):
    """`pushed_experts` with all four exchanges inside GEMMs (`ret.arrive`, push's arrive prologue): the
    dispatch with the first up-projection and the cotangent with d act = d y W_down^T, besides the two
    returns. One custom VJP for the whole expert MLP: the dispatch's kernel yields the received rows
    and the first hidden at once, so the hidden cannot be recomputed on its own. It is kept
    (`ret.keep_hidden`: the policy keeps the expert hidden) or recomputed here from the received rows,
    which are always kept (tagged EXCHANGE_IN): no remat policy reruns the exchange."""
    return _arrived_fwd(x_AD, w_up, w_EFD, group_sizes_E, plan, g_R, ret, activation)[0]


def _arrived_fwd(x_AD, w_up, w_EFD, group_sizes_E, plan, g_R, ret, activation):
    first, *rest = (w.astype(x_AD.dtype) for w in w_up)
    x_MD, h_RF = ret.arrive(
        x_AD, plan, ret.recv_rows, ret.axis_name, ret.max_piece, first, group_sizes_E, False
    )
    x_MD = tag(x_MD, EXCHANGE_IN)
    hidden = _tag_hidden(
        (h_RF, *(gmm(x_MD, w, group_sizes_E, zero_unwritten=False) for w in rest)), activation
    )
    act_RF = _weighted(_act(*hidden, activation), g_R)
    w = w_EFD.astype(act_RF.dtype)
    y_AD = ret.transport.gmm_move(
        act_RF, w, group_sizes_E, plan.reverse(), ret.send_rows, ret.axis_name, ret.max_piece
    )
    kept = hidden if ret.keep_hidden else None
    return y_AD, (x_MD, kept, w_up, w_EFD, group_sizes_E, plan, g_R)


def _arrived_bwd(ret, activation, res, d_AD):
    x_MD, hidden, w_up, w_EFD, group_sizes_E, plan, g_R = res
    if hidden is None:  # recomputed from the kept rows, as remat would (no exchange)
        hidden = _tag_hidden(
            tuple(gmm(x_MD, w.astype(x_MD.dtype), group_sizes_E, zero_unwritten=False) for w in w_up),
            activation,
        )
    dt = x_MD.dtype  # d act = d y W_down^T on arrival, in the activation's dtype
    d_MD, d_act_RF = ret.arrive(
        d_AD.astype(dt),
        plan,
        ret.recv_rows,
        ret.axis_name,
        ret.max_piece,
        w_EFD.astype(dt),
        group_sizes_E,
        True,
    )
    d_hidden, dw_EFD, dg_R = _act_down_bwd(
        hidden, w_EFD, group_sizes_E, None, d_MD, activation, d_act_RF, g_R=g_R
    )
    if activation != "swiglu":
        d_hidden = d_hidden[1:]  # GELU's hidden is (None, up): its gradient is the up-projection's only
    dx_AD, dw_up = _up_return_bwd(x_MD, w_up, group_sizes_E, plan, ret, d_hidden)
    return dx_AD, dw_up, dw_EFD, None, no_cotangent(plan), dg_R


_arrived.defvjp(_arrived_fwd, _arrived_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _arrive_up(x_AD, w_up: tuple, group_sizes_E, plan, ret: Return):
    """Each up-projection of the rows the exchange `plan` brings here (grouped by local expert), [R, F]
    per matrix. The received rows are the backward's residual, tagged EXCHANGE_IN (remat's
    save_exchange keeps them; the exchange is not rerun). d x is the concatenated data-gradient GEMM
    with the reverse exchange inside (`ret.transport.gmm_move`): rows straight back to the sources."""
    return _arrive_up_fwd(x_AD, w_up, group_sizes_E, plan, ret)[0]


def _arrive_up_fwd(x_AD, w_up, group_sizes_E, plan, ret):
    x_MD = tag(ret.transport.move(x_AD, plan, ret.recv_rows, ret.axis_name, ret.max_piece), EXCHANGE_IN)
    hidden = tuple(gmm(x_MD, w.astype(x_MD.dtype), group_sizes_E, zero_unwritten=False) for w in w_up)
    return hidden, (x_MD, w_up, group_sizes_E, plan)


def _arrive_up_bwd(ret, res, d_hidden):
    x_MD, w_up, group_sizes_E, plan = res
    dx_AD, dw = _up_return_bwd(x_MD, w_up, group_sizes_E, plan, ret, d_hidden)
    return dx_AD, dw, None, no_cotangent(plan)


def _up_return_bwd(x_MD, w_up, group_sizes_E, plan, ret: Return, d_hidden):
    """The up-projections' backward: d x straight back to the sources (the data-gradient GEMM with the
    reverse exchange inside, `ret.transport.gmm_move`) and d w per matrix."""
    d_RF, w_EDF = _up_bwd_operands(d_hidden, w_up, x_MD.dtype)
    move = ret.transport.gmm_move
    dx_AD = move(
        d_RF,
        w_EDF,
        group_sizes_E,
        plan.reverse(),
        ret.send_rows,
        ret.axis_name,
        ret.max_piece,
        transpose_rhs=True,
    )
    return dx_AD, _split_dw(tgmm(x_MD, d_RF, group_sizes_E), w_up)


_arrive_up.defvjp(_arrive_up_fwd, _arrive_up_bwd)


def _grouped_rows(arrival_R, group_sizes_E, num_rows: int) -> jax.Array:
    """int32 [M, 1]: the grouped row of each arrival row (arrival_R's inverse; R for rows no
    grouped row reads), as permute / combine take a destination."""
    num_grouped = arrival_R.shape[0]
    live_R = jnp.arange(num_grouped, dtype=jnp.int32) < jnp.sum(group_sizes_E)
    src_R = jnp.where(live_R, arrival_R, num_rows)
    grouped_M = jnp.full((num_rows,), num_grouped, jnp.int32)
    return grouped_M.at[src_R].set(jnp.arange(num_grouped, dtype=jnp.int32), mode="drop")[:, None]
