"""Transformer building blocks: RMSNorm, RoPE attention (MHA/GQA), dense MLP (MLA: mla.py).

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
from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.fp8 import dot_fp8
from xmoe_jax.model.attention import attend
from xmoe_jax.model.norm import rms_norm
from xmoe_jax.model.rope import rope
from xmoe_jax.remat import ATTN_CORE, ATTN_QKV, MLP_HIDDEN, MLP_OUT, tag


def param(rngs: nnx.Rngs, shape, logical, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), logical=logical)


def no_constraint(x: jax.Array, names) -> jax.Array:
    del names
    return x


def project(x: jax.Array, w: jax.Array, num_in: int = 1) -> jax.Array:
    """x[..., in] @ w[in, out] over the first `num_in` axes of w (its trailing ones are the output),
    in x's dtype; an FP8 GEMM (fp8/dense.py) when the FP8 policy covers projections."""
    recipe = fp8_context.recipe_for("projections")
    w = w.astype(x.dtype)
    in_shape, out_shape = w.shape[:num_in], w.shape[num_in:]
    lead = x.shape[: x.ndim - num_in]
    if recipe is None:
        return jnp.tensordot(x, w, axes=num_in)
    w_KN = w.reshape(math.prod(in_shape), math.prod(out_shape))
    return dot_fp8(x.reshape(*lead, -1), w_KN, recipe).reshape(*lead, *out_shape)


def dtypes(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale in float32; `shape` is the normalised trailing dims (one or more axes).
    The backward pass keeps only x (model/norm.py)."""

    def __init__(self, dim: int | tuple[int, ...], eps: float, param_dtype, logical=("norm",)):
        shape = (dim,) if isinstance(dim, int) else tuple(dim)
        self.scale = nnx.Param(jnp.ones(shape, param_dtype), logical=logical)
        self.eps = eps
        self.num_axes = len(shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, tuple(range(-self.num_axes, 0)))


Q_NAMES = ("batch", None, "heads", "head_dim")
KV_NAMES = ("batch", None, "kv_heads", "head_dim")


class Attention(nnx.Module):
    """Causal self-attention with RoPE; GQA when num_kv_heads < num_heads.

    Options of published models (all off by default, adding parameters without RNG draws):
    `qkv_bias` adds q/k/v biases (zeros), `qk_norm` an RMSNorm (scale ones) on q and k before
    RoPE, over each head's K ("head") or over the whole projected width H*K / G*K ("full").
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        d, h, g, k = cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.head_size
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.wq = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), std, pdt)
        self.wk = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wv = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wo = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), out_std, pdt)
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((h, k), pdt), logical=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((g, k), pdt), logical=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((g, k), pdt), logical=("kv_heads", "head_dim"))
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(k, cfg.norm_eps, pdt, ("head_dim",))
            self.k_norm = RMSNorm(k, cfg.norm_eps, pdt, ("head_dim",))
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm((h, k), cfg.norm_eps, pdt, ("heads", "head_dim"))
            self.k_norm = RMSNorm((g, k), cfg.norm_eps, pdt, ("kv_heads", "head_dim"))
        self.has_bias, self.has_qk_norm = cfg.qkv_bias, cfg.qk_norm != "none"
        self.theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.implementation = cfg.attention

    def qkv(self, x_BSD: jax.Array, positions: jax.Array, constrain=no_constraint):
        """q [B,S,H,K], k and v [B,S,G,K]: projections (+ bias), q/k norms, RoPE at `positions`
        ([S], or [B,S] per row)."""
        dt = x_BSD.dtype

        def project_one(name, names):  # x @ w[D, heads, K]
            y = project(x_BSD, getattr(self, "w" + name)[...]).astype(dt)
            if self.has_bias:
                y = y + getattr(self, "b" + name)[...].astype(dt)
            return tag(constrain(y, names), ATTN_QKV)

        q_BSHK = project_one("q", Q_NAMES)
        k_BSGK = project_one("k", KV_NAMES)
        v_BSGK = project_one("v", KV_NAMES)
        if self.has_qk_norm:
            q_BSHK, k_BSGK = self.q_norm(q_BSHK), self.k_norm(k_BSGK)
        q_BSHK = rope(q_BSHK, positions, self.theta, self.rope_scaling)
        return q_BSHK, rope(k_BSGK, positions, self.theta, self.rope_scaling), v_BSGK

    def out(self, o_BSHK: jax.Array, constrain=no_constraint) -> jax.Array:
        o_BSHK = tag(constrain(o_BSHK, Q_NAMES), ATTN_CORE)
        return project(o_BSHK, self.wo[...], num_in=2)

    def __call__(self, x_BSD: jax.Array, constrain=no_constraint) -> jax.Array:
        q_BSHK, k_BSGK, v_BSGK = self.qkv(x_BSD, jnp.arange(x_BSD.shape[1]), constrain)
        o_BSHK = attend(q_BSHK, k_BSGK, v_BSGK, self.implementation, shard_names=(Q_NAMES, KV_NAMES))
        return self.out(o_BSHK, constrain)

    def decode(self, x_BTD: jax.Array, cache, constrain=no_constraint):
        """Attention of T new tokens per row against a layer's KV cache (model/kv_cache.py): their
        keys and values are written at the cache's write index first. Returns (out, new cache)."""
        q_BTHK, k_BTGK, v_BTGK = self.qkv(x_BTD, cache.positions(x_BTD.shape[1]), constrain)
        cache = cache.write(k_BTGK, v_BTGK)
        o_BTHK = cache.attend(q_BTHK)
        return self.out(o_BTHK, constrain), cache


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
        w = self.weights()

        def hidden(name):
            return tag(constrain(project(x_BSD, w[name]), ("batch", None, "mlp")), MLP_HIDDEN)

        h_BSF = hidden("w_up")
        h_BSF = jax.nn.silu(hidden("w_gate")) * h_BSF if self.activation == "swiglu" else jax.nn.gelu(h_BSF)
        return tag(project(h_BSF, w["w_down"]), MLP_OUT)
