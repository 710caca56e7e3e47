"""Next-token cross-entropy without materialising [B,S,V] float32 logits.

Shapes: B batch, S sequence, C positions per chunk, N = S / C chunks, D model, V vocab.

The sequence is cut into N chunks of C positions; a scan computes each chunk's
logits [B,C,V] in float32, its logsumexp and target logit, and adds its summed loss.
The chunk body is rematerialised (`jax.checkpoint`), so the backward pass recomputes
one chunk's logits at a time instead of keeping all of them: peak logits memory is
B*C*V floats instead of B*S*V. C is the largest divisor of S not above
`model.loss_chunk` (0: one chunk, the whole sequence).
"""

from __future__ import annotations

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
    num_b, seq, dim = h_BSD.shape
    c = chunk_size(seq, chunk)
    n = seq // c
    h_NBCD = h_BSD.reshape(num_b, n, c, dim).swapaxes(0, 1)
    t_NBC = targets_BS.reshape(num_b, n, c).swapaxes(0, 1)
    xs = (h_NBCD, t_NBC)
    if weights_BS is not None:
        xs += (weights_BS.astype(jnp.float32).reshape(num_b, n, c).swapaxes(0, 1),)

    @jax.checkpoint
    def chunk_loss(h_BCD, t_BC, *w_BC):
        logits_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV).astype(jnp.float32)
        if constrain is not None:
            logits_BCV = constrain(logits_BCV, ("batch", None, "vocab"))
        lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        target_BC = jnp.take_along_axis(logits_BCV, t_BC[..., None], axis=-1)[..., 0]
        loss_BC = lse_BC - target_BC
        return jnp.sum(loss_BC * w_BC[0] if w_BC else loss_BC)

    def step(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), xs)
    if weights_BS is None:
        return total / (num_b * seq)
    return total / jnp.maximum(jnp.sum(xs[2]), 1.0)
