"""Next-token cross-entropy without materialising [B,S,V] float32 logits, its gradient taken in
the forward pass.

Shapes: B batch, S sequence, C positions per chunk, N = S / C chunks, D model, V vocab.

The sequence is cut into N chunks of C positions; a scan computes each chunk's logits [B,C,V] in
float32, its logsumexp and target logit, and adds its weighted loss. Peak logits memory is B*C*V
floats instead of B*S*V. C is the largest divisor of S not above `model.loss_chunk` (0: one chunk,
the whole sequence).

The loss is the last thing the forward pass computes and its gradient is the first thing the
backward pass needs, so the chunk that has its logits at hand also takes their gradient:
d logits = (softmax - onehot(target)) * weight, then d h = d logits W^T and d W += h^T d logits
(float32 across chunks). The backward pass only scales the two by the loss's cotangent (1 for the
training loss). That is three matmuls per chunk, as a plain forward and backward take, where
recomputing each chunk's logits in the backward pass (as a rematerialised chunk would) takes
four: the LM head's forward ran twice, 18 ms of a 318 ms step of the Small shapes x 4 layers on
one H200 (benchmarks/train_step.md). As the gradient of a matmul in bfloat16, d logits is rounded
to the compute dtype before its two matmuls; d W sums its chunks in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def chunk_size(seq_len: int, requested: int) -> int:
    """The largest divisor of seq_len that is at most `requested` (seq_len itself for 0)."""
    if requested <= 0 or requested >= seq_len:
        return seq_len
    return max(c for c in range(1, requested + 1) if seq_len % c == 0)


def chunked_cross_entropy(h_BSD, w_DV, targets_BS, chunk: int, constrain=None, weights_BS=None) -> jax.Array:
    """mean over B*S of logsumexp(h @ w) - (h @ w)[target], in float32; with `weights_BS` (0/1:
    which positions count, as in multi-token prediction) the mean over the counted positions."""
    num_b, seq, _ = h_BSD.shape
    if weights_BS is None:
        scale_BS = jnp.full((num_b, seq), 1.0 / (num_b * seq), jnp.float32)
    else:
        weights_BS = jax.lax.stop_gradient(weights_BS.astype(jnp.float32))
        scale_BS = weights_BS / jnp.maximum(jnp.sum(weights_BS), 1.0)
    return _weighted_ce(h_BSD, w_DV, targets_BS, scale_BS, chunk_size(seq, chunk), constrain)


def _chunks(x_BS, c: int):
    """[B, S, ...] -> [N, B, C, ...]: the scan's chunks."""
    num_b, seq = x_BS.shape[:2]
    return x_BS.reshape(num_b, seq // c, c, *x_BS.shape[2:]).swapaxes(0, 1)


def _scan(h_BSD, w_DV, t_BS, scale_BS, c: int, constrain, grads: bool):
    """(loss, (d h [B,S,D], d W [D,V] float32) if grads) of sum(scale * (logsumexp - target logit))."""
    num_b, seq, dim = h_BSD.shape

    def body(carry, xs):
        total, dw_DV = carry
        h_BCD, t_BC, s_BC = xs
        logits_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV).astype(jnp.float32)
        if constrain is not None:
            logits_BCV = constrain(logits_BCV, ("batch", None, "vocab"))
        lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        target_BC = jnp.take_along_axis(logits_BCV, t_BC[..., None], axis=-1)[..., 0]
        total = total + jnp.sum((lse_BC - target_BC) * s_BC)
        if not grads:
            return (total, dw_DV), None
        p_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
        onehot_BCV = jax.nn.one_hot(t_BC, logits_BCV.shape[-1], dtype=jnp.float32)
        d_BCV = ((p_BCV - onehot_BCV) * s_BC[..., None]).astype(h_BCD.dtype)
        if constrain is not None:
            d_BCV = constrain(d_BCV, ("batch", None, "vocab"))
        dh_BCD = jnp.einsum("bcv,dv->bcd", d_BCV, w_DV)
        dw_DV = dw_DV + jnp.einsum("bcd,bcv->dv", h_BCD, d_BCV, preferred_element_type=jnp.float32)
        return (total, dw_DV), dh_BCD

    dw0 = jnp.zeros(w_DV.shape, jnp.float32) if grads else jnp.zeros((), jnp.float32)
    xs = (_chunks(h_BSD, c), _chunks(t_BS, c), _chunks(scale_BS, c))
    (total, dw_DV), dh_NBCD = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dw0), xs)
    if not grads:
        return total, None
    return total, (dh_NBCD.swapaxes(0, 1).reshape(num_b, seq, dim), dw_DV)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _weighted_ce(h_BSD, w_DV, t_BS, scale_BS, c: int, constrain):
    return _scan(h_BSD, w_DV, t_BS, scale_BS, c, constrain, grads=False)[0]


def _weighted_ce_fwd(h_BSD, w_DV, t_BS, scale_BS, c, constrain):
    total, (dh_BSD, dw_DV) = _scan(h_BSD, w_DV, t_BS, scale_BS, c, constrain, grads=True)
    return total, (dh_BSD, dw_DV, jnp.zeros((), w_DV.dtype))  # d W stays float32 until it is scaled


def _weighted_ce_bwd(c, constrain, res, g):
    dh_BSD, dw_DV, w_dtype = res
    return (g * dh_BSD).astype(dh_BSD.dtype), (g * dw_DV).astype(w_dtype.dtype), None, None


_weighted_ce.defvjp(_weighted_ce_fwd, _weighted_ce_bwd)
