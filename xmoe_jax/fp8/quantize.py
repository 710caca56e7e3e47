"""Quantize to FP8 with current (just-in-time) scaling, and dequantize.

Legend: the blocked tensor's axes keep their own letters; a `block` gives, per axis, the tile
length along it (None: the whole axis). One float32 scale per tile, `scale = amax / fp8_max`, so
that x ~ q * scale (q the fp8 payload). The three recipes (recipe.py) are three block shapes:
  tensorwise  every axis None             one scale per tensor
  rowwise     (1, None) for x_MK          one scale per row over the contraction axis
  blockwise   (1, 128) / (128, 128)       DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks

Edge cases, as the tests state them:
  * overflow saturates: x / scale is clipped to +-fp8_max before the cast (float8_e4m3fn has no
    inf, so an unclipped cast of 1e6 would be NaN, not 448);
  * an all-zero tile gets scale 1 (not 0, which would make 0/0 = NaN);
  * a tile holding NaN or +-inf gets a NaN scale, so the whole tile dequantizes to NaN: a
    non-finite value is never clipped into a finite one and the step's loss shows it.
Axes whose length is not a multiple of the block are padded with zeros for the amax only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.fp8.formats import max_value


def _blocks(shape, block) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tile length, number of tiles) per axis."""
    if len(block) != len(shape):
        raise ValueError(f"block {tuple(block)} must give one entry per axis of shape {tuple(shape)}")
    sizes = tuple(d if b is None else min(int(b), d) for d, b in zip(shape, block, strict=True))
    if any(s < 1 for s in sizes):
        raise ValueError(f"block entries must be >= 1 or None, got {tuple(block)}")
    return sizes, tuple(math.ceil(d / s) if d else 1 for d, s in zip(shape, sizes, strict=True))


def scale_shape(shape, block) -> tuple[int, ...]:
    """Shape of the scales of a tensor of `shape` quantized in `block` tiles."""
    return _blocks(shape, block)[1]


def _tile_amax(x, block):
    sizes, counts = _blocks(x.shape, block)
    pad = [(0, c * s - d) for d, s, c in zip(x.shape, sizes, counts, strict=True)]
    xa = jnp.pad(jnp.abs(x.astype(jnp.float32)), pad)
    tiled = xa.reshape([v for c, s in zip(counts, sizes, strict=True) for v in (c, s)])
    return jnp.max(tiled, axis=tuple(range(1, 2 * x.ndim, 2)))  # NaN and inf propagate into the amax


def expand_scale(scale, shape, block):
    """Scales repeated to one per element of `shape` (float32)."""
    sizes, _ = _blocks(shape, block)
    out = scale
    for axis, s in enumerate(sizes):
        out = jnp.repeat(out, s, axis=axis, total_repeat_length=scale.shape[axis] * s)
    return out[tuple(slice(0, d) for d in shape)]


def compute_scale(amax, dtype):
    """amax / fp8_max per tile (as amax * float32(1 / fp8_max), which XLA would make of the division
    anyway); 1 for all-zero tiles; NaN for tiles holding NaN or inf."""
    inv_fmax = np.float32(1.0 / max_value(dtype))
    scale = jnp.where(amax > 0, amax * inv_fmax, 1.0)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan).astype(jnp.float32)


def quantize(x: jax.Array, block, dtype) -> tuple[jax.Array, jax.Array]:
    """(q in `dtype`, float32 scales of shape scale_shape(x.shape, block)); x ~ q * scale per tile."""
    scale = compute_scale(_tile_amax(x, block), dtype)
    fmax = max_value(dtype)
    y = x.astype(jnp.float32) / expand_scale(scale, x.shape, block)
    return jnp.clip(y, -fmax, fmax).astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, block, out_dtype=jnp.float32) -> jax.Array:
    """q * scale per tile, in `out_dtype` (a barrier keeps XLA:GPU from folding a quantize's
    f32 -> fp8 -> f32 round trip away under xla_allow_excess_precision)."""
    q = jax.lax.optimization_barrier(q)
    return (q.astype(jnp.float32) * expand_scale(scale, q.shape, block)).astype(out_dtype)


def fake_quantize(x: jax.Array, block, dtype) -> jax.Array:
    """dequantize(quantize(x)) in x's dtype: the values an FP8 GEMM really multiplies."""
    q, scale = quantize(x, block, dtype)
    return dequantize(q, scale, block, x.dtype)
