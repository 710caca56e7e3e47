"""Multi-head latent attention (DeepSeek-V2/V3): every head's keys and values come from one
compressed latent per token, so generation caches C + R numbers per token and layer, not 2*H*K.

Shapes: B batch, S sequence, T new tokens (generation), D model, H heads. MLA's own letters:
C kv_lora_rank (the compressed latent), Q q_lora_rank (the query latent), N qk_nope_head_dim,
R qk_rope_head_dim, K = N + R query/key dims per head, U v_head_dim (not V: the vocabulary).

Training and prefill (DeepSeek-V2 paper, eqs. 9-19):
  1. queries: x @ wq [D,H,K], or with q_lora_rank norm(x @ wq_a [D,Q]) @ wq_b [Q,H,K]; each
     head's K dims are q_nope [N] and q_rope [R]; RoPE on q_rope;
  2. the latent: x @ wkv_a [D,C+R] = (c [C], k_rope [R]); c = norm(c); RoPE on k_rope, one
     vector shared by all heads;
  3. expansion: c @ wkv_b [C,H,N+U] = (k_nope [H,N], v [H,U]); k = [k_nope, k_rope] per head;
  4. causal softmax attention, scale K^-1/2 times YaRN's mscale^2 (rope.py), by the backend of
     `model.attention` (attention.py pads v to K dims for every backend), then o @ wo [H,U,D].
Generation (`decode`): the KV cache (kv_cache.py) holds c and the roped k_rope. wkv_b is absorbed
instead of expanding the cache (DeepSeek's inference): q_nope @ wk_b [C,H,N] moves each query
head into latent space, logits = q_latent . c + q_rope . k_rope, and wv_b [C,H,U] maps the
attention-weighted latent back out; the same numbers up to rounding.

Tensor parallelism as for MHA: wq / wq_b and wkv_b are split by heads (column-parallel), wo by
heads (row-parallel); the down-projections wq_a and wkv_a and their norms are small and
replicated, so every tensor rank computes the latent itself.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xmoe_jax.config import ModelConfig
from xmoe_jax.model.attention import attend
from xmoe_jax.model.layers import Q_NAMES, RMSNorm, dtypes, no_constraint, param
from xmoe_jax.model.rope import rope, softmax_mscale
from xmoe_jax.remat import ATTN_CORE, ATTN_QKV, tag

LATENT_NAMES = ("batch", None, "latent")


class MLAttention(nnx.Module):
    """Causal multi-head latent attention (steps of the module docstring); the interface of
    layers.Attention (`__call__`, `decode`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        m, d, h = cfg.mla, cfg.hidden, cfg.num_heads
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        heads = ("heads", "head_dim")
        if m.q_lora_rank is None:
            self.wq = param(rngs, (d, h, m.qk_head_dim), ("embed", *heads), std, pdt)
        else:
            self.wq_a = param(rngs, (d, m.q_lora_rank), ("embed", "latent"), std, pdt)
            self.q_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps, pdt)
            self.wq_b = param(rngs, (m.q_lora_rank, h, m.qk_head_dim), ("latent", *heads), std, pdt)
        self.wkv_a = param(rngs, (d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "latent"), std, pdt)
        self.kv_norm = RMSNorm(m.kv_lora_rank, cfg.norm_eps, pdt)
        kv_b = (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim)
        self.wkv_b = param(rngs, kv_b, ("latent", *heads), std, pdt)
        self.wo = param(rngs, (h, m.v_head_dim, d), (*heads, "embed"), out_std, pdt)
        self.latent_dim, self.nope_dim = m.kv_lora_rank, m.qk_nope_head_dim
        self.theta, self.rope_scaling, self.interleave = cfg.rope_theta, cfg.rope_scaling, m.rope_interleave
        self.scale = m.qk_head_dim**-0.5 * softmax_mscale(cfg.rope_scaling)
        self.implementation = cfg.attention

    def _rope(self, x, positions):
        return rope(x, positions, self.theta, self.rope_scaling, self.interleave)

    def queries(self, x_BSD: jax.Array, positions: jax.Array, constrain=no_constraint):
        """(q_nope [B,S,H,N], roped q_rope [B,S,H,R]): step 1."""
        dt = x_BSD.dtype
        if hasattr(self, "wq"):
            q_BSHK = jnp.einsum("bsd,dhk->bshk", x_BSD, self.wq[...].astype(dt))
        else:
            cq_BSQ = tag(x_BSD @ self.wq_a[...].astype(dt), ATTN_QKV)
            q_BSHK = jnp.einsum("bsq,qhk->bshk", self.q_norm(cq_BSQ), self.wq_b[...].astype(dt))
        q_BSHK = tag(constrain(q_BSHK, Q_NAMES), ATTN_QKV)
        return q_BSHK[..., : self.nope_dim], self._rope(q_BSHK[..., self.nope_dim :], positions)

    def latent(self, x_BSD: jax.Array, positions: jax.Array, constrain=no_constraint):
        """(normed latent c [B,S,C], roped shared k_rope [B,S,1,R]): step 2."""
        kv_BSX = tag(constrain(x_BSD @ self.wkv_a[...].astype(x_BSD.dtype), LATENT_NAMES), ATTN_QKV)
        c_BSC, kr_BSR = kv_BSX[..., : self.latent_dim], kv_BSX[..., self.latent_dim :]
        return self.kv_norm(c_BSC), self._rope(kr_BSR[:, :, None, :], positions)

    def out(self, o_BSHU: jax.Array, constrain=no_constraint) -> jax.Array:
        o_BSHU = tag(constrain(o_BSHU, Q_NAMES), ATTN_CORE)
        return jnp.einsum("bshu,hud->bsd", o_BSHU, self.wo[...].astype(o_BSHU.dtype))

    def __call__(self, x_BSD: jax.Array, constrain=no_constraint) -> jax.Array:
        positions = jnp.arange(x_BSD.shape[1])
        qn_BSHN, qr_BSHR = self.queries(x_BSD, positions, constrain)
        c_BSC, kr_BS1R = self.latent(x_BSD, positions, constrain)
        kv_BSHX = jnp.einsum("bsc,chx->bshx", c_BSC, self.wkv_b[...].astype(x_BSD.dtype))
        kv_BSHX = tag(constrain(kv_BSHX, Q_NAMES), ATTN_QKV)
        kn_BSHN, v_BSHU = kv_BSHX[..., : self.nope_dim], kv_BSHX[..., self.nope_dim :]
        q_BSHK = jnp.concatenate([qn_BSHN, qr_BSHR], axis=-1)
        kr_BSHR = jnp.broadcast_to(kr_BS1R, (*kn_BSHN.shape[:3], kr_BS1R.shape[-1]))
        k_BSHK = jnp.concatenate([kn_BSHN, kr_BSHR], axis=-1)
        o_BSHU = attend(q_BSHK, k_BSHK, v_BSHU, self.implementation, (Q_NAMES, Q_NAMES), self.scale)
        return self.out(o_BSHU, constrain)

    def decode(self, x_BTD: jax.Array, cache, constrain=no_constraint):
        """T new tokens per row against the layer's latent cache (c in the cache's key slot, k_rope
        in its value slot), written first; wkv_b absorbed (module docstring). (out, new cache)."""
        dt = x_BTD.dtype
        positions = cache.positions(x_BTD.shape[1])
        qn_BTHN, qr_BTHR = self.queries(x_BTD, positions, constrain)
        c_BTC, kr_BT1R = self.latent(x_BTD, positions, constrain)
        cache = cache.write(c_BTC[:, :, None, :], kr_BT1R)
        c_BSC, kr_BSR = cache.k_BSGK[:, :, 0].astype(dt), cache.v_BSGK[:, :, 0].astype(dt)
        w_CHX = self.wkv_b[...].astype(dt)
        wk_CHN, wv_CHU = w_CHX[..., : self.nope_dim], w_CHX[..., self.nope_dim :]
        ql_BTHC = jnp.einsum("bthn,chn->bthc", qn_BTHN, wk_CHN)
        logits_BHTS = jnp.einsum("bthc,bsc->bhts", ql_BTHC, c_BSC) + jnp.einsum(
            "bthr,bsr->bhts", qr_BTHR, kr_BSR
        )
        logits_BHTS = jnp.where(
            cache.mask_BTS(x_BTD.shape[1])[:, None],
            logits_BHTS.astype(jnp.float32) * self.scale,
            jnp.finfo(jnp.float32).min,
        )
        p_BHTS = jax.nn.softmax(logits_BHTS, axis=-1).astype(dt)
        ol_BTHC = jnp.einsum("bhts,bsc->bthc", p_BHTS, c_BSC)
        return self.out(jnp.einsum("bthc,chu->bthu", ol_BTHC, wv_CHU), constrain), cache
