"""Rotary position embeddings: plain RoPE and YaRN scaling, rotate-half or interleaved pairs.

Shapes: B batch, S sequence, H heads, K rotated dims (K/2 frequencies).

RoPE rotates dim pairs (x1_i, x2_i) by the angle position * freq_i, freq_i = theta^(-2i/K).
Pairs are the two halves of the K dims (rotate-half, LLaMA/Qwen/Mixtral checkpoints) or adjacent
dims 2i, 2i+1 (`interleave`, DeepSeek's checkpoints); the interleaved output is written as
[rotated evens, rotated odds], a fixed permutation of the dims that queries and keys share, so
their dot products equal those of DeepSeek's layout.

YaRN (`model.rope_scaling`, DeepSeek-V2/V3's config.json; Peng et al. 2023), as transformers'
`_compute_yarn_parameters` and DeepSeek's reference code compute it:
  1. dims whose wavelength turns more than `beta_fast` times over the original context keep their
     frequency (extrapolation), those turning fewer than `beta_slow` times are divided by
     `factor` (interpolation), a linear ramp in between (bounds floored / ceiled);
  2. cos and sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim),
     mscale(s, m) = 0.1 m ln(s) + 1 (mscale(factor) when either is 0);
  3. MLA multiplies its softmax scale by mscale(factor, mscale_all_dim)^2 (`softmax_mscale`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.config import RopeScalingConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScalingConfig) -> np.ndarray:
    """The K/2 YaRN frequencies (float64), step 1 of the module docstring."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    span = high - low if high != low else 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / span, 0, 1)
    keep = 1.0 - ramp  # the share of each dim that extrapolates
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(scaling: RopeScalingConfig | None) -> float:
    """The factor on cos and sin (step 2)."""
    if scaling is None:
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def softmax_mscale(scaling: RopeScalingConfig | None) -> float:
    """MLA's factor on its softmax scale (step 3): 1 without YaRN or without mscale_all_dim."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope(
    x_BSHK: jax.Array,
    positions: jax.Array,
    theta: float,
    scaling: RopeScalingConfig | None = None,
    interleave: bool = False,
) -> jax.Array:
    """Rotary embedding in float32; `positions` [S] or per row [B,S]."""
    half = x_BSHK.shape[-1] // 2
    if scaling is None:
        freq_k = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        freq_k = jnp.asarray(yarn_inv_freq(2 * half, theta, scaling), jnp.float32)
    angle = positions.astype(jnp.float32)[..., None] * freq_k  # [..., S, K/2]
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # a heads axis
    if scaling is not None:
        factor = attention_factor(scaling)
        cos, sin = cos * factor, sin * factor
    x = x_BSHK.astype(jnp.float32)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSHK.dtype)
