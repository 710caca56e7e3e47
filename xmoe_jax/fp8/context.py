"""Which GEMMs of the model run in FP8 while it is traced: an ambient policy, like the mesh.

    with fp8.context.use(cfg.fp8):        # model/transformer.py, around the blocks (not the
        ...                               # embedding, the LM head or the loss)
    recipe = fp8.context.recipe_for("experts")      # moe/experts.py: gmm_fp8 or gmm
    recipe = fp8.context.recipe_for("projections")  # attention q/k/v/o, dense and shared MLPs
    recipe = fp8.context.recipe_for("dispatch")     # moe/pft.py: routed rows sent in FP8 (dispatch.py)

The policy is read at trace time only (a static Python branch, never in the compiled step), so
the backward passes do not need it: gmm_fp8 and dot_fp8 carry their recipe in their custom VJPs.
The router, norms and attention scores never ask.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Literal

from xmoe_jax.fp8.recipe import Recipe

_POLICY: contextvars.ContextVar = contextvars.ContextVar("xmoe_fp8_policy", default=None)


@contextlib.contextmanager
def use(cfg):
    """FP8 per `cfg` (config.FP8Config, or None: off) inside the block."""
    policy = None
    if cfg is not None:
        recipe = Recipe(cfg.recipe, grad_format=cfg.grad_format, fast_accum=cfg.fast_accum)
        policy = {
            "experts": recipe if cfg.experts else None,
            "projections": recipe if cfg.projections else None,
            "dispatch": recipe if cfg.dispatch else None,
        }
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def recipe_for(kind: Literal["experts", "projections", "dispatch"]) -> Recipe | None:
    """The recipe for this kind of GEMM, or None (compute dtype)."""
    policy = _POLICY.get()
    return None if policy is None else policy[kind]
