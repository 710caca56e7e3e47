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

Under data or expert parallelism the batch is split over P devices, and a [D, V] sum of d W would
need an all-reduce inside the chunk loop, one per chunk (as the recomputing backward pass had, in
the compute dtype). The chunks carry [P, ...] sums instead, split like the batch, so each device
adds only its own rows; the sums over P after the loop are the one reduction per call
(`tests/test_scale.py::test_chunked_loss_never_builds_full_logits` reads the compiled program).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xmoe_jax import sharding


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
    shards = sharding.logical_size(sharding.current_mesh(), "batch") if constrain is not None else 1
    shards = shards if num_b % shards == 0 else 1
    return _weighted_ce(h_BSD, w_DV, targets_BS, scale_BS, (chunk_size(seq, chunk), shards), constrain)


def _logsumexp(logits):
    """Over the vocab axis. XLA makes it two passes over the chunk's logits (max, then sum of exp). One
    variadic reduction carrying both (the online softmax's merge) saves a read but lost on an H100: the
    loss took 9.35 ms over its GEMMs against 8.72 (scripts/bench_loss.py, benchmarks/train_step.md)."""
    return jax.nn.logsumexp(logits, axis=-1)


def _chunks(x_BS, c: int, shards: int):
    """[B, S, ...] -> [N, P, b, C, ...] (b = B/P): the scan's chunks, each over P batch shards."""
    num_b, seq = x_BS.shape[:2]
    x = x_BS.reshape(shards, num_b // shards, seq // c, c, *x_BS.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def _scan(h_BSD, w_DV, t_BS, scale_BS, split: tuple[int, int], constrain, grads: bool):
    """(loss, (d h [B,S,D], d W [D,V] float32) if grads) of sum(scale * (logsumexp - target logit)).

    P = split[1] is the number of devices the batch is split over. Each carries its own partial loss
    and d W ([P, ...], split like the batch), so no chunk reduces across devices: the sums over P
    after the scan are the only reduction (one all-reduce of d W per call, where a [D, V] carry took
    one per chunk)."""
    num_b, seq, dim = h_BSD.shape
    c, shards = split
    names = ("batch", None, None, "vocab")
    pin = constrain or (lambda x, _: x)

    def body(carry, xs):
        total_P, dw_PDV = carry
        h_PbCD, t_PbC, s_PbC = xs
        logits_PbCV = pin(jnp.einsum("pbcd,dv->pbcv", h_PbCD, w_DV).astype(jnp.float32), names)
        lse_PbC = _logsumexp(logits_PbCV)
        target_PbC = jnp.take_along_axis(logits_PbCV, t_PbC[..., None], axis=-1)[..., 0]
        total_P = total_P + jnp.sum((lse_PbC - target_PbC) * s_PbC, axis=(1, 2))
        if not grads:
            return (total_P, dw_PDV), None
        p_PbCV = jnp.exp(logits_PbCV - lse_PbC[..., None])
        onehot_PbCV = jax.nn.one_hot(t_PbC, logits_PbCV.shape[-1], dtype=jnp.float32)
        d_PbCV = pin(((p_PbCV - onehot_PbCV) * s_PbC[..., None]).astype(h_PbCD.dtype), names)
        dh_PbCD = jnp.einsum("pbcv,dv->pbcd", d_PbCV, w_DV)
        f32 = jnp.float32
        if shards == 1:  # one plain GEMM accumulating into the carry
            chunk_PDV = jnp.einsum("bcd,bcv->dv", h_PbCD[0], d_PbCV[0], preferred_element_type=f32)[None]
        else:
            chunk_PDV = jnp.einsum("pbcd,pbcv->pdv", h_PbCD, d_PbCV, preferred_element_type=f32)
        return (total_P, pin(dw_PDV + chunk_PDV, ("batch", None, "vocab"))), dh_PbCD

    total0 = pin(jnp.zeros((shards,), jnp.float32), ("batch",))
    dw0 = pin(jnp.zeros((shards, *w_DV.shape), jnp.float32), ("batch", None, "vocab")) if grads else total0
    xs = (_chunks(h_BSD, c, shards), _chunks(t_BS, c, shards), _chunks(scale_BS, c, shards))
    (total_P, dw_PDV), dh_NPbCD = jax.lax.scan(body, (total0, dw0), xs)
    if not grads:
        return total_P.sum(), None
    dh_BSD = jnp.moveaxis(dh_NPbCD, 0, 2).reshape(num_b, seq, dim)  # via [P, b, N, C, D]
    return total_P.sum(), (dh_BSD, dw_PDV.sum(0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _weighted_ce(h_BSD, w_DV, t_BS, scale_BS, split: tuple[int, int], constrain):
    return _scan(h_BSD, w_DV, t_BS, scale_BS, split, constrain, grads=False)[0]


def _weighted_ce_fwd(h_BSD, w_DV, t_BS, scale_BS, split, constrain):
    total, (dh_BSD, dw_DV) = _scan(h_BSD, w_DV, t_BS, scale_BS, split, constrain, grads=True)
    return total, (dh_BSD, dw_DV, jnp.zeros((), w_DV.dtype))  # d W stays float32 until it is scaled


def _weighted_ce_bwd(split, constrain, res, g):
    dh_BSD, dw_DV, w_dtype = res
    return (g * dh_BSD).astype(dh_BSD.dtype), (g * dw_DV).astype(w_dtype.dtype), None, None


_weighted_ce.defvjp(_weighted_ce_fwd, _weighted_ce_bwd)
