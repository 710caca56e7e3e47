"""The LM loss with its gradient (model/loss.py) on the one-GPU step's shapes, against its own GEMMs.

    python scripts/bench_loss.py --out loss.json             # one GPU, about a minute
    python scripts/bench_loss.py --tiny --out /tmp/l.json    # CPU dry run

The X-MoE Small's head on one GPU (`configs/tiny_small_shape.yaml`: 32 x 2048 tokens, D 2048, vocab
50,304, chunks of 128 positions, bf16): the loss and d h, d W of `chunked_cross_entropy`, timed beside
the same-run baseline, the chunk loop's three GEMMs alone (logits, d h, d W: the same FLOPs, nothing
between them). The time over that baseline is what the loss's element-wise passes cost (logsumexp,
target logit, d logits). Rows: `two_pass` (the train step's: jax.nn.logsumexp, which XLA makes a max
pass and a sum pass over each chunk's logits) and `online` (one variadic reduction carrying both; it
lost). Each is checked first against the same loss in float32 (relative error of the loss and of both
gradients).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.model import loss as loss_mod
from xmoe_jax.perf.recorder import Recorder
from xmoe_jax.perf.timing import environment, rel_err, time_fn


def _merge(a, b):
    """Two partial (max, sum of exp(x - max)) pairs as one; a max of -inf (nothing seen) keeps its sum 0."""
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)

    def rescaled(m_i, s_i):  # s_i * exp(m_i - m), without exp(-inf - -inf)
        return jnp.where(m_i == m, s_i, s_i * jnp.exp(m_i - m))

    return m, rescaled(m_a, s_a) + rescaled(m_b, s_b)


def online_logsumexp(x):
    """The same in one pass: one variadic reduction carries the running max and the sum of exp(x - max)."""
    x = x.astype(jnp.float32)
    m, s = jax.lax.reduce(
        (x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)), _merge, (x.ndim - 1,)
    )
    return m + jnp.log(s)


VARIANTS = {"two_pass": loss_mod._logsumexp, "online": online_logsumexp}


def _gemms(chunk: int):
    """The loss's three matmuls per chunk and nothing else (d logits = the logits)."""

    def run(h_BSD, w_DV):
        b, s, d = h_BSD.shape
        h_NBCD = jnp.moveaxis(h_BSD.reshape(b, s // chunk, chunk, d), 1, 0)

        def body(dw_DV, h_BCD):
            logits_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV)
            dh_BCD = jnp.einsum("bcv,dv->bcd", logits_BCV, w_DV)
            dw = jnp.einsum("bcd,bcv->dv", h_BCD, logits_BCV, preferred_element_type=jnp.float32)
            return dw_DV + dw, dh_BCD

        return jax.lax.scan(body, jnp.zeros(w_DV.shape, jnp.float32), h_NBCD)

    return jax.jit(run)


def main(args) -> None:
    b, s, d, v, chunk = (2, 64, 32, 300, 16) if args.tiny else (32, 2048, 2048, 50_304, 128)
    rec = Recorder(args.out, {**environment(), "batch": b, "seq": s, "hidden": d, "vocab": v, "chunk": chunk})
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    h32 = jax.random.normal(kh, (b, s, d), jnp.float32)
    w32 = jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)  # logits of about unit size
    t = jax.random.randint(kt, (b, s), 0, v)
    h, w = h32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    flops = 3 * 2 * b * s * d * v

    def grad_fn():
        return jax.jit(
            jax.value_and_grad(lambda h, w: loss_mod.chunked_cross_entropy(h, w, t, chunk), argnums=(0, 1))
        )

    with jax.default_matmul_precision("highest"):
        ref_loss, ref_grads = grad_fn()(h32, w32)
    t_gemm = time_fn(_gemms(chunk), h, w, iters=args.iters)
    rec.add(variant="gemms_only", ms=t_gemm * 1e3, tflops=flops / t_gemm / 1e12)
    table = [("gemms_only", t_gemm, None)]
    original = loss_mod._logsumexp
    try:
        for name in args.variants:
            loss_mod._logsumexp = VARIANTS[name]
            fn = grad_fn()
            val, grads = fn(h, w)
            err = max(rel_err(val, ref_loss), *(rel_err(g, r) for g, r in zip(grads, ref_grads, strict=True)))
            t_v = time_fn(fn, h, w, iters=args.iters)
            rec.add(variant=name, ms=t_v * 1e3, tflops=flops / t_v / 1e12, rel_err=err, loss=float(val))
            table.append((name, t_v, err))
    finally:
        loss_mod._logsumexp = original
    print("| variant | ms | TFLOP/s (3 head GEMMs) | x gemms only | ms over gemms | rel. err vs float32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, secs, err in table:
        e = "-" if err is None else f"{err:.1e}"
        print(
            f"| {name} | {secs * 1e3:.3f} | {flops / secs / 1e12:.0f} | {secs / t_gemm:.3f} "
            f"| {(secs - t_gemm) * 1e3:.3f} | {e} |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes that run on a CPU in seconds")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    main(p.parse_args())
