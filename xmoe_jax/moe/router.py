"""Routers and their balancing losses.

Shapes: T tokens, D model, E experts, K top-k, G expert groups, S tokens per sequence.

`route` follows the published definitions (all in float32):
  softmax (Mixtral / Qwen2-MoE): p = softmax(logits) over all E; take the top-k of p;
      weights = chosen p, renormalised over the k when `norm_topk_prob`.
  sigmoid (DeepSeek-V3): s = sigmoid(logits); choose with s + bias (the bias is a
      selection-only correction, never differentiated); with groups, rank groups by the
      sum of their two largest (s + bias), keep `topk_groups` groups, take top-k inside
      them; weights = s at the chosen experts (no bias), normalised when
      `norm_topk_prob`, times `routed_scaling_factor`.
  force_balance (benchmarking, as the vendors' tables): the experts are chosen round-robin
      instead (`balanced_choice`); the weights are the scores above at those experts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.config import MoEConfig


class Routing(NamedTuple):
    topk_idx_TK: jax.Array  # int32 expert ids
    topk_weight_TK: jax.Array  # float32 combine weights
    scores_TE: jax.Array  # float32 per-expert affinities used by the balance loss
    logits_TE: jax.Array  # float32 raw router logits


@jax.custom_vjp
def router_logits(x_TD: jax.Array, kernel_DE: jax.Array) -> jax.Array:
    """Router logits in float32 whatever the compute dtype. The backward pass keeps x in its own
    dtype and upcasts it again (autodiff would keep the float32 copy: twice a bf16 x's bytes)."""
    return jnp.einsum("td,de->te", x_TD.astype(jnp.float32), kernel_DE.astype(jnp.float32))


def _logits_fwd(x_TD, kernel_DE):
    return router_logits(x_TD, kernel_DE), (x_TD, kernel_DE)


def _logits_bwd(res, d_TE):
    x_TD, kernel_DE = res
    dx_TD = jnp.einsum("te,de->td", d_TE, kernel_DE.astype(jnp.float32))
    dk_DE = jnp.einsum("td,te->de", x_TD.astype(jnp.float32), d_TE)
    return dx_TD.astype(x_TD.dtype), dk_DE.astype(kernel_DE.dtype)


router_logits.defvjp(_logits_fwd, _logits_bwd)


def _group_limited_scores(sel_TE: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Masks experts outside each token's `topk_groups` best groups with -inf."""
    num_tokens = sel_TE.shape[0]
    per_group = cfg.num_experts // cfg.num_groups
    sel_TGe = sel_TE.reshape(num_tokens, cfg.num_groups, per_group)
    top2_TGt, _ = jax.lax.top_k(sel_TGe, min(2, per_group))
    group_score_TG = top2_TGt.sum(-1)
    _, top_groups_TH = jax.lax.top_k(group_score_TG, cfg.topk_groups)
    keep_TG = jnp.zeros((num_tokens, cfg.num_groups), bool)
    keep_TG = keep_TG.at[jnp.arange(num_tokens)[:, None], top_groups_TH].set(True)
    keep_TE = jnp.repeat(keep_TG, per_group, axis=1)
    return jnp.where(keep_TE, sel_TE, -jnp.inf)


def route(x_TD: jax.Array, kernel_DE: jax.Array, bias_E: jax.Array | None, cfg: MoEConfig) -> Routing:
    """Chooses `top_k` experts per token and their combine weights."""
    logits_TE = router_logits(x_TD, kernel_DE)
    if cfg.score_func == "softmax":
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        topk_weight_TK, topk_idx_TK = jax.lax.top_k(probs_TE, cfg.top_k)
        scores_TE = probs_TE
    else:
        s_TE = jax.nn.sigmoid(logits_TE)
        sel_TE = s_TE if bias_E is None else s_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
        if cfg.num_groups > 1:
            sel_TE = _group_limited_scores(sel_TE, cfg)
        _, topk_idx_TK = jax.lax.top_k(jax.lax.stop_gradient(sel_TE), cfg.top_k)
        topk_weight_TK = jnp.take_along_axis(s_TE, topk_idx_TK, axis=-1)
        scores_TE = s_TE / (s_TE.sum(-1, keepdims=True) + 1e-20)
    if cfg.force_balance:  # benchmarking: every expert the same count (MoEConfig.force_balance)
        weights_TE = probs_TE if cfg.score_func == "softmax" else s_TE
        topk_idx_TK = balanced_choice(logits_TE.shape[0], cfg.top_k, cfg.num_experts)
        topk_weight_TK = jnp.take_along_axis(weights_TE, topk_idx_TK, axis=-1)
    if cfg.norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(-1, keepdims=True) + 1e-20)
    topk_weight_TK = topk_weight_TK * cfg.routed_scaling_factor
    return Routing(topk_idx_TK.astype(jnp.int32), topk_weight_TK, scores_TE, logits_TE)


def balanced_choice(num_tokens: int, top_k: int, num_experts: int) -> jax.Array:
    """int32 [T, K]: token t's copies to experts (t*K + j) mod E, k distinct experts per token and
    (when E divides T*K) exactly T*K/E copies per expert."""
    t_T, j_K = jnp.arange(num_tokens, dtype=jnp.int32), jnp.arange(top_k, dtype=jnp.int32)
    return (t_T[:, None] * top_k + j_K[None, :]) % num_experts


def tokens_per_expert(topk_idx_TK: jax.Array, num_experts: int) -> jax.Array:
    """Routed copies per expert (before any capacity drop), int32 [E]."""
    return jnp.zeros((num_experts,), jnp.int32).at[topk_idx_TK.reshape(-1)].add(1)


def load_balance_loss(
    scores_TE: jax.Array,
    topk_idx_TK: jax.Array,
    cfg: MoEConfig,
    seq_len: int | None = None,
    axis_names: tuple[str, ...] = (),
) -> jax.Array:
    """sum_e f_e * P_e with f_e = E/(K*T) * count_e and P_e = mean_t scores_te.

    Equals 1 for perfectly uniform routing. `micro_batch` treats all T tokens as one
    group; `sequence` (DeepSeek-V3's sequence-wise loss) computes it per sequence of
    `seq_len` tokens and averages (with `seq_len=None` the T tokens are one sequence,
    which is the micro-batch loss). Inside shard_map, `axis_names` are the mesh axes
    the tokens are split over: the statistics are reduced over them, so the loss is
    that of the whole batch.
    """
    if cfg.aux_loss_type == "none":
        return jnp.zeros((), jnp.float32)
    num_tokens, num_experts = scores_TE.shape
    counts_TE = jax.nn.one_hot(topk_idx_TK, num_experts, dtype=jnp.float32).sum(1)
    if cfg.aux_loss_type == "micro_batch" or seq_len is None:
        total = _psum(jnp.asarray(num_tokens, jnp.float32), axis_names)
        f_E = _psum(counts_TE.sum(0), axis_names) * (num_experts / (cfg.top_k * total))
        p_E = _psum(scores_TE.sum(0), axis_names) / total
        return (f_E * p_E).sum()
    if num_tokens % seq_len:
        raise ValueError(
            f"sequence-wise aux loss: {num_tokens} tokens are not a multiple of seq_len={seq_len}"
        )
    num_seq = num_tokens // seq_len
    f_BE = counts_TE.reshape(num_seq, seq_len, num_experts).sum(1) * (num_experts / (cfg.top_k * seq_len))
    p_BE = scores_TE.reshape(num_seq, seq_len, num_experts).mean(1)
    return _pmean((f_BE * p_BE).sum(-1).mean(), axis_names)


def _psum(x: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
    return jax.lax.psum(x, axis_names) if axis_names else x


def _pmean(x: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
    return jax.lax.pmean(x, axis_names) if axis_names else x


def z_loss(logits_TE: jax.Array, axis_names: tuple[str, ...] = ()) -> jax.Array:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE)."""
    return _pmean(jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))), axis_names)


def update_router_bias(bias_E: jax.Array, tokens_per_expert_E: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: bias += rate * sign(mean_load - load_e) (per layer for [L, E])."""
    load_E = tokens_per_expert_E.astype(jnp.float32)
    return bias_E + rate * jnp.sign(load_E.mean(-1, keepdims=True) - load_E)
