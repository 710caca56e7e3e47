"""AdamW with linear warmup + cosine decay and global-norm clipping (optax).

The update of step t (count from 1), as optax.adamw computes it:
  1. g = clip_by_global_norm(grads, optimizer.grad_clip);
  2. mu = b1 mu + (1-b1) g,  nu = b2 nu + (1-b2) g^2;
     u = (mu / (1-b1^t)) / (sqrt(nu / (1-b2^t)) + eps)   (eps outside the root);
  3. u += weight_decay * p where `decay_mask` says so (decoupled: not through the moments);
  4. p -= lr(t-1) * u, lr warming up linearly from 0 then cosine to min_lr_ratio * lr.

Weight decay is decided by what a parameter is (the name of its leaf), never by its rank: the
layer stacks give every per-layer vector a leading layer axis, so a rank rule decays norms.
  - not decayed: RMSNorm scales (every `.../scale` leaf: attn_norm, mlp_norm, final_norm, the
    q/k norms, MLA's latent norms, the MTP norms) and biases (`bq`, `bk`, `bv`), as Megatron-LM,
    HF Trainer and nanoGPT exclude norms and biases;
  - decayed: every weight matrix, the token embedding and the LM head included (as Megatron-LM,
    HF Trainer and nanoGPT do), the router kernel (Megatron-LM) and MTP's eh_proj;
  - the router's selection bias (aux-loss-free balancing) is no trained parameter: the optimizer
    never sees it.

`optimizer.state_dtype=bfloat16` stores both moments in bfloat16 (DeepSeek-V3 does): 4 bytes per
parameter instead of 8. Each step reads them into float32, updates, and rounds back. With b2 near
1 (1-b2 below bfloat16's resolution, ~2^-8) the second moment cannot shrink by rounding and
stays high (smaller updates); the default b2=0.95 is clear of that.

`guarded_update` applies one step and keeps it only where it is finite (the train step's guard;
benchmarks/optimizer.md measures it against the unguarded update and torch's fused AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xmoe_jax.config import OptimizerConfig
from xmoe_jax.train import weight_copy

# leaf names that are not decayed, and why
NO_DECAY = {"scale": "norm scale", "bq": "bias", "bk": "bias", "bv": "bias", "bias": "bias"}


def _decay_steps(cfg: OptimizerConfig, total_steps: int) -> int:
    decay = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    return max(decay, cfg.warmup_steps + 1)


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The learning rate inside the jitted step (traced with it)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=_decay_steps(cfg, total_steps),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def lr_on_host(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """`lr_schedule`'s value at a step, computed on the host for the metrics log (float64; the step
    computes it in float32). Calling the optax schedule outside jit ran each of its dozen jnp ops
    as a small compile of its own the first time: ~12 compiles inside the first logged window,
    which made its tokens/s 2-4x low (issue 31)."""
    peak, end, warmup = cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.warmup_steps
    decay = _decay_steps(cfg, total_steps) - warmup

    def lr(step: int) -> float:
        if step < warmup:  # optax.linear_schedule from 0 to peak over `warmup` steps
            return peak * max(step, 0) / warmup
        frac = min(step - warmup, decay) / decay  # optax.cosine_decay_schedule(peak, decay, end / peak)
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))

    return lr


def decay_mask(params):
    """True for the leaves weight decay applies to (module docstring): all but norm scales and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: weight_copy.leaf_name(path) not in NO_DECAY, params
    )


def scale_by_adam_stored_as(dtype, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in `dtype` and every step computed in float32.
    The state is optax's `ScaleByAdamState`, so checkpoints keep one layout for every dtype."""

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, dtype)  # noqa: E731
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        bc1 = 1 - b1 ** count.astype(jnp.float32)
        bc2 = 1 - b2 ** count.astype(jnp.float32)

        def one(g, m, v):
            g32 = g.astype(jnp.float32)
            m32 = b1 * m.astype(jnp.float32) + (1 - b1) * g32
            v32 = b2 * v.astype(jnp.float32) + (1 - b2) * g32 * g32
            u = (m32 / bc1) / (jnp.sqrt(v32 / bc2) + eps)
            return u.astype(g.dtype), m32.astype(dtype), v32.astype(dtype)

        out = jax.tree.map(one, updates, state.mu, state.nu)
        treedef = jax.tree.structure(updates)
        u, mu, nu = (
            jax.tree.unflatten(treedef, [t[i] for t in treedef.flatten_up_to(out)]) for i in range(3)
        )
        return u, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    if cfg.state_dtype == "float32":
        adam = optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    else:
        adam = scale_by_adam_stored_as(jnp.dtype(cfg.state_dtype), cfg.b1, cfg.b2, cfg.eps)
    # = optax.adamw(..., mask=decay_mask) for float32 state
    adamw = optax.chain(
        adam,
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(lr_schedule(cfg, total_steps)),
    )
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(clip_by_global_norm(cfg.grad_clip), adamw)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm, the same arithmetic and state, that takes the norm when given
    (`update(..., grad_norm=n)`): the step's guard has computed it already, and inside the guard's
    branch XLA cannot reuse it, so optax's own would read every gradient a second time (4 bytes
    per parameter, benchmarks/optimizer.md)."""

    def update(updates, state, params=None, *, grad_norm=None, **extra):
        del params, extra
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        keep = jnp.squeeze(norm < max_norm)
        return jax.tree.map(
            lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates
        ), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


# |g_i| <= GRAD_CAP for every applied gradient: both moments then stay finite (v <= 1e36)
GRAD_CAP = 1e18
# updates below this leave params (|p| of order 1, never near 3.4e38) finite, with margin
UPDATE_LIMIT = float(np.finfo(np.float32).max) / 16


def update_bound(cfg: OptimizerConfig, total_steps: int) -> Callable[[object, jax.Array], jax.Array]:
    """f(opt_state, grad_norm) -> a bound on every |update| this step can make (a float32 scalar);
    inf where the gradient may not be applied: its norm (after clipping) is above GRAD_CAP, or NaN.

    Why it holds: every applied gradient has |g_i| <= its clipped global norm <= G, with G =
    min(grad_clip, GRAD_CAP) (GRAD_CAP without clipping). The moments start at zero and are convex
    mixes, so |m_i| <= G and v_i <= G^2 at every step; with the bias corrections 1 - b^t,
    |m_hat| <= G / (1 - b1), and |m_hat| / (sqrt(v_hat) + eps) <= G / ((1 - b1) eps). The step's
    learning rate (the schedule at the optimizer's count: a NaN one makes the bound NaN) multiplies
    it. Weight decay adds lr * wd * |p|, which cannot leave float32's range for finite params."""
    schedule = lr_schedule(cfg, total_steps)
    clip = cfg.grad_clip
    cap = min(clip, GRAD_CAP) if clip is not None else GRAD_CAP

    def bound(opt, grad_norm: jax.Array) -> jax.Array:
        counts = [
            s.count
            for s in jax.tree.leaves(opt, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
            if isinstance(s, optax.ScaleByScheduleState)
        ]
        if len(counts) != 1:
            raise ValueError(
                f"update_bound: expected one learning-rate schedule in the optimizer state, found {len(counts)}"
            )
        norm = grad_norm.astype(jnp.float32)
        applied = jnp.minimum(norm, clip) if clip is not None else norm  # NaN stays NaN
        lr = schedule(counts[0]).astype(jnp.float32)
        return jnp.where(applied <= GRAD_CAP, lr * cap / ((1 - cfg.b1) * cfg.eps), jnp.inf)

    return bound


def guarded_update(
    optimizer: optax.GradientTransformation, params, opt, grads, allowed: jax.Array, bound, weights=None
) -> tuple:
    """One optimizer step, kept only where it is allowed and finite: (params, opt, grad_norm, finite,
    weights).

    `finite`: the gradient norm is finite and `bound` (`update_bound` of the optimizer's config) says
    no update can leave float32's range. The new params and moments replace the old ones where
    `allowed & finite`, else the old ones stay. Both are scalars known before the update, so the
    keep is a branch (`lax.cond`) around the plain update, which XLA fuses as it does unguarded; the
    clipping in the branch takes the norm computed here (`clip_by_global_norm`), so the gradients
    are read once for it: 32 bytes per float32 parameter in all. A check of the updates themselves
    (the guard before) cannot start writing before a full read pass: 56 bytes per parameter, 1.7x
    the time. A per-element select of new against old (`jnp.where`) made XLA copy both moments
    first in the train step, since the params' update re-reads the old moments the select
    overwrites (benchmarks/optimizer.md).

    `weights`: the params' compute-dtype copies (train/weight_copy.py, None: none), made afresh from
    the new params in the same branch. A gradient may come in a lower precision than its param (a
    copied weight's): it is widened where it is read, inside the norm's and the update's passes.
    """
    grad_norm = optax.tree.norm(weight_copy.widened(grads, params))
    finite = jnp.isfinite(grad_norm) & (bound(opt, grad_norm) < UPDATE_LIMIT)

    def apply(args):
        p, o, g, w = args
        updates, new_o = optimizer.update(weight_copy.widened(g, p), o, p, grad_norm=grad_norm)
        new_p = optax.apply_updates(p, updates)
        return new_p, new_o, weight_copy.refreshed(new_p, w)

    def keep(args):
        p, o, _, w = args
        return p, o, w

    new_params, new_opt, new_weights = jax.lax.cond(
        allowed & finite, apply, keep, (params, opt, grads, weights)
    )
    return new_params, new_opt, grad_norm, finite, new_weights
