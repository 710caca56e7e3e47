"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from xmoe_jax.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(decay, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    """Weight decay on matrices only, not on norm scales."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=_decay_mask,
    )
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
