"""RMSNorm as a function with a hand-written backward pass that keeps only its bf16 input.

    y = x / sqrt(mean(x^2 over `axes`) + eps) * scale      (computed in float32, returned in x's dtype)

Autodiff of the float32 formula keeps two float32 copies of x for the backward pass (the
upcast and the normalised value): 4 bytes x 2 per element where the input itself is 2. The
custom VJP below keeps x (in its own dtype) and the scale, and recomputes the rest:

    xhat = x * r,  r = rsqrt(mean(x^2) + eps)
    d scale = sum over the non-normalised dims of dy * xhat
    d x     = r * (g - xhat * mean(g * xhat)),  g = dy * scale

Both in float32, cast back to the inputs' dtypes. It equals autodiff of the formula up to
float32 rounding (tests/test_model.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _normalise(x, eps: float, axes: tuple[int, ...]):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    return x32 * r, r


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, eps: float, axes: tuple[int, ...]):
    """RMSNorm of x over its trailing `axes` with `scale` (the normalised dims' shape)."""
    xhat, _ = _normalise(x, eps, axes)
    return (xhat * scale.astype(jnp.float32)).astype(x.dtype)


def _fwd(x, scale, eps, axes):
    return rms_norm(x, scale, eps, axes), (x, scale)


def _bwd(eps, axes, res, dy):
    x, scale = res
    xhat, r = _normalise(x, eps, axes)
    dy32 = dy.astype(jnp.float32)
    lead = tuple(range(x.ndim - scale.ndim))
    dscale = jnp.sum(dy32 * xhat, axis=lead)
    g = dy32 * scale.astype(jnp.float32)
    dx = r * (g - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_fwd, _bwd)
