"""Transformer building blocks: RMSNorm, RoPE attention (MHA/GQA), dense MLP.

Shapes: B batch, S sequence, D model, H query heads, G kv heads, K head dim,
F MLP hidden, V vocab. Parameters are float32 masters (`param_dtype`) and are cast
to the compute dtype at use. Every parameter carries its logical axis names in the
`logical` metadata; xmoe_jax.sharding maps them to mesh axes.

Tensor parallelism (Megatron style): `constrain` (logical names -> mesh, from the
caller) pins q/k/v and the MLP hidden to heads / F split over the tensor axis: the
input projections are column-parallel, the output projections row-parallel, and
their partial sums are reduced by the partitioner into the layout the caller asks
for (all-reduce; reduce-scatter over the sequence under sequence parallelism).
Inside attention and MLPs the sequence is whole.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xmoe_jax.config import ModelConfig
from xmoe_jax.model.attention import attend
from xmoe_jax.remat import ATTN_CORE, ATTN_QKV, MLP_HIDDEN, MLP_OUT, tag


def param(rngs: nnx.Rngs, shape, logical, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), logical=logical)


def no_constraint(x: jax.Array, names) -> jax.Array:
    del names
    return x


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
        self.implementation = cfg.attention

    def __call__(self, x_BSD: jax.Array, constrain=no_constraint) -> jax.Array:
        dt = x_BSD.dtype
        positions_S = jnp.arange(x_BSD.shape[1])
        q_names, kv_names = ("batch", None, "heads", "head_dim"), ("batch", None, "kv_heads", "head_dim")

        def project(w, spec, names):
            return tag(constrain(jnp.einsum(spec, x_BSD, w[...].astype(dt)), names), ATTN_QKV)

        q_BSHK = project(self.wq, "bsd,dhk->bshk", q_names)
        k_BSGK = project(self.wk, "bsd,dgk->bsgk", kv_names)
        v_BSGK = project(self.wv, "bsd,dgk->bsgk", kv_names)
        q_BSHK, k_BSGK = rope(q_BSHK, positions_S, self.theta), rope(k_BSGK, positions_S, self.theta)
        o_BSHK = attend(q_BSHK, k_BSGK, v_BSGK, self.implementation, shard_names=(q_names, kv_names))
        o_BSHK = tag(constrain(o_BSHK, q_names), ATTN_CORE)
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

    def __call__(self, x_BSD: jax.Array, constrain=no_constraint) -> jax.Array:
        """SwiGLU down(silu(x @ gate) * (x @ up)) or GELU down(gelu(x @ up)); F column/row split."""
        dt, w = x_BSD.dtype, self.weights()

        def hidden(name):
            return tag(constrain(x_BSD @ w[name].astype(dt), ("batch", None, "mlp")), MLP_HIDDEN)

        h_BSF = hidden("w_up")
        h_BSF = jax.nn.silu(hidden("w_gate")) * h_BSF if self.activation == "swiglu" else jax.nn.gelu(h_BSF)
        return tag(h_BSF @ w["w_down"].astype(dt), MLP_OUT)
