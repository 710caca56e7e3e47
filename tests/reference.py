"""Independent NumPy float64 references for routing, capacity, the MoE layer and attention.

Written from the published definitions (docs/design.md#routers; capacity: docs/design.md#pft),
not from the library code, and deliberately loop-based where that makes the definition obvious.
Shapes use the library's suffix legend: T tokens, D model, E experts, K top-k, F expert hidden,
S sequence, H heads.
"""

from __future__ import annotations

import math

import numpy as np

from xmoe_jax.config import MoEConfig


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def rel_err(a, b) -> float:
    a, b = f64(a), f64(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def gelu_tanh(x):
    # jax.nn.gelu defaults to the tanh approximation
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x * sigmoid(x)


# ----------------------------------------------------------------------------- routing


def route_ref(x_TD, kernel_DE, bias_E, cfg: MoEConfig):
    """(topk_idx_TK, topk_weight_TK, logits_TE, scores_TE), one token at a time."""
    logits_TE = f64(x_TD) @ f64(kernel_DE)
    num_tokens, num_experts = logits_TE.shape
    idx = np.zeros((num_tokens, cfg.top_k), np.int64)
    wts = np.zeros((num_tokens, cfg.top_k))
    if cfg.score_func == "softmax":
        scores_TE = softmax(logits_TE)
        for t in range(num_tokens):
            p = scores_TE[t]
            chosen = sorted(range(num_experts), key=lambda e, p=p: -p[e])[: cfg.top_k]
            w = p[chosen]
            if cfg.norm_topk_prob:
                w = w / w.sum()
            idx[t], wts[t] = chosen, w * cfg.routed_scaling_factor
        return idx, wts, logits_TE, scores_TE

    s_TE = sigmoid(logits_TE)
    bias = np.zeros(num_experts) if bias_E is None else f64(bias_E)
    per_group = num_experts // cfg.num_groups
    for t in range(num_tokens):
        sel = s_TE[t] + bias
        allowed = list(range(num_experts))
        if cfg.num_groups > 1:
            group_score = []
            for g in range(cfg.num_groups):
                members = sorted(sel[g * per_group : (g + 1) * per_group], reverse=True)
                group_score.append(sum(members[:2]))
            best = sorted(range(cfg.num_groups), key=lambda g, gs=group_score: -gs[g])[: cfg.topk_groups]
            allowed = [e for e in range(num_experts) if e // per_group in best]
        chosen = sorted(allowed, key=lambda e, sel=sel: -sel[e])[: cfg.top_k]
        w = s_TE[t, chosen]  # weights come from the un-biased scores
        if cfg.norm_topk_prob:
            w = w / w.sum()
        idx[t], wts[t] = chosen, w * cfg.routed_scaling_factor
    scores_TE = s_TE / s_TE.sum(-1, keepdims=True)
    return idx, wts, logits_TE, scores_TE


def load_balance_ref(scores_TE, topk_idx_TK, num_experts: int, top_k: int, group: int) -> float:
    """mean over groups of sum_e f_e * P_e, f_e = E/(K*group) * count_e, P_e = mean scores."""
    scores_TE, topk_idx_TK = f64(scores_TE), np.asarray(topk_idx_TK)
    losses = []
    for start in range(0, scores_TE.shape[0], group):
        counts = np.zeros(num_experts)
        for row in topk_idx_TK[start : start + group]:
            for e in row:
                counts[e] += 1
        f = num_experts / (top_k * group) * counts
        p = scores_TE[start : start + group].mean(0)
        losses.append(float((f * p).sum()))
    return float(np.mean(losses))


def z_loss_ref(logits_TE) -> float:
    logits_TE = f64(logits_TE)
    m = logits_TE.max(-1)
    lse = m + np.log(np.exp(logits_TE - m[:, None]).sum(-1))
    return float(np.mean(lse**2))


# ----------------------------------------------------------------------------- capacity


def keep_ref(topk_idx_TK, topk_weight_TK, num_experts: int, capacity: int | None, policy: str):
    """keep_TK by walking each expert's queue in priority order."""
    topk_idx_TK = np.asarray(topk_idx_TK)
    weights = np.asarray(topk_weight_TK)
    num_tokens, top_k = topk_idx_TK.shape
    copies = [(t, k) for t in range(num_tokens) for k in range(top_k)]
    if policy == "probs":  # highest weight first; ties: earlier token, lower slot
        copies.sort(key=lambda c: (-float(weights[c]), c[0], c[1]))
    else:  # first choices in token order, then second choices, ...
        copies.sort(key=lambda c: (c[1], c[0]))
    keep = np.zeros((num_tokens, top_k), bool)
    used = [0] * num_experts
    for t, k in copies:
        e = topk_idx_TK[t, k]
        if capacity is None or used[e] < capacity:
            keep[t, k] = True
        used[e] += 1
    return keep


# ----------------------------------------------------------------------------- MoE layer


def mlp_ref(x_D, w_gate, w_up, w_down, activation: str):
    if activation == "swiglu":
        h = silu(x_D @ w_gate) * (x_D @ w_up)
    else:
        h = gelu_tanh(x_D @ w_up)
    return h @ w_down


def moe_ref(params: dict, x_TD, cfg: MoEConfig, keep_TK=None):
    """Loop reference: y_t = sum_k w_tk * expert_{e_tk}(x_t) (+ gated shared expert)."""
    p = {k: {n: f64(v) for n, v in d.items()} for k, d in params.items()}
    x_TD = f64(x_TD)
    idx, wts, _, _ = route_ref(x_TD, p["router"]["kernel"], p["router"].get("bias"), cfg)
    ex = p["experts"]
    y_TD = np.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(cfg.top_k):
            if keep_TK is not None and not keep_TK[t, k]:
                continue
            e = idx[t, k]
            gate = ex["w_gate"][e] if cfg.activation == "swiglu" else None
            y_TD[t] += wts[t, k] * mlp_ref(x_TD[t], gate, ex["w_up"][e], ex["w_down"][e], cfg.activation)
        if "shared" in p:
            sh = p["shared"]
            ys = mlp_ref(x_TD[t], sh.get("w_gate"), sh["w_up"], sh["w_down"], cfg.activation)
            if "gate" in sh:
                ys = ys * sigmoid(x_TD[t] @ sh["gate"][:, 0])
            y_TD[t] += ys
    return y_TD, idx


# ----------------------------------------------------------------------------- attention


def rope_ref(x_SHK, theta: float):
    """Rotate-half RoPE: [x1*cos - x2*sin, x2*cos + x1*sin], freq_i = theta^(-i/half)."""
    seq, _, head_dim = x_SHK.shape
    half = head_dim // 2
    out = np.empty_like(x_SHK)
    for s in range(seq):
        for i in range(half):
            angle = s * theta ** (-i / half)
            c, si = math.cos(angle), math.sin(angle)
            x1, x2 = x_SHK[s, :, i], x_SHK[s, :, i + half]
            out[s, :, i] = x1 * c - x2 * si
            out[s, :, i + half] = x2 * c + x1 * si
    return out


def rms_norm_ref(x, scale, axes, eps: float):
    """x / sqrt(mean(x^2 over `axes`) + eps) * scale."""
    return x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps) * f64(scale)


def attention_ref(x_SD, wq_DHK, wk_DGK, wv_DGK, wo_HKD, theta: float, bias=None, qk_norm=None, eps=1e-6):
    """Causal GQA attention of one sequence; kv head g serves query heads g*H/G .. (g+1)*H/G - 1.

    `bias`: (bq [H,K], bk [G,K], bv [G,K]) added to the projections; `qk_norm`: (kind, q scale,
    k scale), kind "head" (RMSNorm over each head's K) or "full" (over the whole H*K / G*K),
    applied to q and k before RoPE (Qwen3 / OLMoE).
    """
    x_SD = f64(x_SD)
    wq, wk, wv, wo = map(f64, (wq_DHK, wk_DGK, wv_DGK, wo_HKD))
    num_heads, num_kv = wq.shape[1], wk.shape[1]
    q = np.einsum("sd,dhk->shk", x_SD, wq)
    k = np.einsum("sd,dgk->sgk", x_SD, wk)
    v = np.einsum("sd,dgk->sgk", x_SD, wv)
    if bias is not None:
        q, k, v = q + f64(bias[0]), k + f64(bias[1]), v + f64(bias[2])
    if qk_norm is not None:
        kind, q_scale, k_scale = qk_norm
        axes = (-1,) if kind == "head" else (-2, -1)
        q, k = rms_norm_ref(q, q_scale, axes, eps), rms_norm_ref(k, k_scale, axes, eps)
    q, k = rope_ref(q, theta), rope_ref(k, theta)
    k = np.repeat(k, num_heads // num_kv, axis=1)
    v = np.repeat(v, num_heads // num_kv, axis=1)
    seq, head_dim = x_SD.shape[0], q.shape[-1]
    out = np.zeros((seq, num_heads, head_dim))
    for h in range(num_heads):
        for s in range(seq):
            logits = q[s, h] @ k[: s + 1, h].T / math.sqrt(head_dim)
            out[s, h] = softmax(logits) @ v[: s + 1, h]
    return np.einsum("shk,hkd->sd", out, wo)


# ----------------------------------------------------------------------------- multi-head latent attention


def yarn_freqs_ref(dim: int, base: float, yarn: dict | None):
    """Rotary frequencies of the dim/2 pairs: base^(-2i/dim), or YaRN's blend as DeepSeek's
    reference code defines it (yarn_find_correction_range, yarn_linear_ramp_mask): a ramp over the
    pair index between floor(low) and ceil(high), the dims turning beta_fast and beta_slow times
    over the original context; pair i keeps (1 - ramp_i) of its own frequency and takes ramp_i of
    the frequency divided by `factor`."""
    freqs = [base ** (-2 * i / dim) for i in range(dim // 2)]
    if yarn is None:
        return freqs

    def turns_to_dim(turns):
        return (
            dim
            * math.log(yarn["original_max_position_embeddings"] / (turns * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(turns_to_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(turns_to_dim(yarn["beta_slow"])), dim - 1)
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low if high != low else 0.001), 0.0), 1.0)
        out.append(f / yarn["factor"] * ramp + f * (1 - ramp))
    return out


def yarn_mscale_ref(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rotate_pairs_ref(vec, pos: int, freqs, pairs, factor: float):
    """A copy of `vec` with each pair (a, b) of `pairs` rotated by pos * freq, times `factor`."""
    out = np.array(vec, dtype=np.float64)
    for (a, b), f in zip(pairs, freqs, strict=True):
        c, s = math.cos(pos * f) * factor, math.sin(pos * f) * factor
        out[a], out[b] = vec[a] * c - vec[b] * s, vec[b] * c + vec[a] * s
    return out


def mla_ref(x_SD, w: dict, num_heads: int, dims: dict, theta: float, eps: float, yarn=None, interleave=True):
    """Causal multi-head latent attention of one sequence, from DeepSeek-V2's equations (9)-(19)
    with the released models' RMSNorms on the query and key/value latents and V3's YaRN:

      c^KV_t = norm(W^DKV h_t),  [k^C_{t,i}; v^C_{t,i}] = W^UKV c^KV_t,  k^R_t = RoPE(W^KR h_t)
      q_t = W^Q h_t  or  W^UQ norm(W^DQ h_t);  q_{t,i} = [q^C_{t,i}; RoPE(q^R_{t,i})]
      o_{t,i} = sum_{j<=t} softmax_j(q_{t,i} . [k^C_{j,i}; k^R_j] * scale) v^C_{j,i},  u_t = W^O o_t

    `w`: wq [D,H,K] or wq_a [D,Q] + q_norm [Q] + wq_b [Q,H,K]; wkv_a [D,C+R] (W^DKV and W^KR);
    kv_norm [C]; wkv_b [C,H,N+U]; wo [H,U,D]. `dims`: C, N, R, U. RoPE pairs are adjacent dims
    (interleave) or the two halves of the R dims; scale = (N+R)^-1/2 * mscale(factor, mscale_all_dim)^2
    with YaRN, whose cos and sin carry mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    """
    x = f64(x_SD)
    w = {k: f64(v) for k, v in w.items()}
    C, N, R = dims["C"], dims["N"], dims["R"]
    seq = x.shape[0]
    if "wq" in w:
        q = np.einsum("sd,dhk->shk", x, w["wq"])
    else:
        q = np.einsum("sq,qhk->shk", rms_norm_ref(x @ w["wq_a"], w["q_norm"], (-1,), eps), w["wq_b"])
    kv = x @ w["wkv_a"]
    c = rms_norm_ref(kv[:, :C], w["kv_norm"], (-1,), eps)
    k_rope = kv[:, C:]
    kv_b = np.einsum("sc,chx->shx", c, w["wkv_b"])
    k_nope, v = kv_b[..., :N], kv_b[..., N:]
    freqs = yarn_freqs_ref(R, theta, yarn)
    pairs = (
        [(2 * i, 2 * i + 1) for i in range(R // 2)]
        if interleave
        else [(i, i + R // 2) for i in range(R // 2)]
    )
    factor, scale = 1.0, (N + R) ** -0.5
    if yarn is not None:
        factor = yarn_mscale_ref(yarn["factor"], yarn["mscale"]) / yarn_mscale_ref(
            yarn["factor"], yarn["mscale_all_dim"]
        )
        scale *= yarn_mscale_ref(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    out = np.zeros((seq, num_heads, v.shape[-1]))
    for t in range(seq):
        k_r = [rotate_pairs_ref(k_rope[j], j, freqs, pairs, factor) for j in range(t + 1)]
        for i in range(num_heads):
            q_ti = np.concatenate([q[t, i, :N], rotate_pairs_ref(q[t, i, N:], t, freqs, pairs, factor)])
            logits = np.array([q_ti @ np.concatenate([k_nope[j, i], k_r[j]]) * scale for j in range(t + 1)])
            out[t, i] = softmax(logits) @ v[: t + 1, i]
    return np.einsum("shu,hud->sd", out, w["wo"])
