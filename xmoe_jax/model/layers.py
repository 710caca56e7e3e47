"""Transformer building blocks: RMSNorm, RoPE attention (MHA/GQA), dense MLP.

Shapes: B batch, S sequence, D model, H query heads, G kv heads, K head dim,
F MLP hidden, V vocab. Parameters are float32 masters (`param_dtype`) and are cast
to the compute dtype at use. Every parameter carries its logical axis names in the
`logical` metadata; xmoe_jax.sharding maps them to mesh axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xmoe_jax.config import ModelConfig
from xmoe_jax.moe.experts import dense_mlp


def param(rngs: nnx.Rngs, shape, logical, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), logical=logical)


def dtypes(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical=("norm",))
        self.eps = eps

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x32 = x_BSD.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x_BSD.dtype)


def rope(x_BSHK: jax.Array, positions_S: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half convention) in float32."""
    half = x_BSHK.shape[-1] // 2
    freq_k = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_SK = positions_S.astype(jnp.float32)[:, None] * freq_k[None, :]
    cos, sin = jnp.cos(angle_SK)[None, :, None, :], jnp.sin(angle_SK)[None, :, None, :]
    x1, x2 = jnp.split(x_BSHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSHK.dtype)


class Attention(nnx.Module):
    """Causal self-attention with RoPE; GQA when num_kv_heads < num_heads."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        d, h, g, k = cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.head_size
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.wq = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), std, pdt)
        self.wk = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wv = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wo = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), out_std, pdt)
        self.theta = cfg.rope_theta

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        dt = x_BSD.dtype
        positions_S = jnp.arange(x_BSD.shape[1])
        q_BSHK = rope(jnp.einsum("bsd,dhk->bshk", x_BSD, self.wq[...].astype(dt)), positions_S, self.theta)
        k_BSGK = rope(jnp.einsum("bsd,dgk->bsgk", x_BSD, self.wk[...].astype(dt)), positions_S, self.theta)
        v_BSGK = jnp.einsum("bsd,dgk->bsgk", x_BSD, self.wv[...].astype(dt))
        o_BSHK = jax.nn.dot_product_attention(q_BSHK, k_BSGK, v_BSGK, is_causal=True)
        return jnp.einsum("bshk,hkd->bsd", o_BSHK, self.wo[...].astype(dt))


class MLP(nnx.Module):
    """Dense feed-forward (SwiGLU or GELU), also used for the first-k dense layers."""

    def __init__(self, dim: int, hidden: int, activation: str, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        if activation == "swiglu":
            self.w_gate = param(rngs, (dim, hidden), ("embed", "mlp"), std, pdt)
        self.w_up = param(rngs, (dim, hidden), ("embed", "mlp"), std, pdt)
        self.w_down = param(rngs, (hidden, dim), ("mlp", "embed"), out_std, pdt)
        self.activation = activation

    def weights(self) -> dict:
        names = ("w_gate", "w_up", "w_down") if self.activation == "swiglu" else ("w_up", "w_down")
        return {n: getattr(self, n)[...] for n in names}

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return dense_mlp(x_BSD, self.weights(), self.activation)
