"""Validation helpers every config dataclass uses: each failed check raises `ConfigError` with a
message naming the field and the fix."""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

from xmoe_jax.config.choices import removed
from xmoe_jax.errors import ConfigError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choices(obj: Any, prefix: str) -> None:
    """Every `Literal`-typed field of a config dataclass holds one of its values."""
    for name, tp in typing.get_type_hints(type(obj)).items():
        base, _ = _resolve_type(tp)
        value = getattr(obj, name)
        if typing.get_origin(base) is Literal and value is not None:
            choices = typing.get_args(base)
            _check(
                value in choices,
                removed(base, value, prefix + name)
                or f"{prefix}{name}={value!r} is not one of {list(choices)}",
            )


# Numeric fields: every float must be finite, and every number at least its lower bound, which is
# 1 for ints and 0 for floats unless listed here as (bound, strict). Runs after each component's own
# checks (whose messages are more specific) and catches the rest: head_dim=0, rope_theta=-1, a NaN
# init_std, capacity_factor=.inf, lr=inf.
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "MoEConfig.num_shared_experts": (0, False),
    "ModelConfig.num_dense_layers": (0, False),
    "ModelConfig.mtp_depth": (0, False),
    "ModelConfig.loss_chunk": (0, False),
    "MeshConfig.data": (-1, False),
    "OptimizerConfig.warmup_steps": (0, False),
    "TrainConfig.seed": (0, False),
    "DataConfig.seed": (0, False),
    "EvalConfig.every": (0, False),
    "ModelConfig.rope_theta": (0, True),
    "ModelConfig.norm_eps": (0, True),
    "ModelConfig.init_std": (0, True),
    "MoEConfig.routed_scaling_factor": (0, True),
    "OptimizerConfig.lr": (0, True),
    "OptimizerConfig.eps": (0, True),
    "TrainConfig.peak_tflops": (0, True),
}


def _check_numbers(obj: Any, prefix: str) -> None:
    """Every int / float field of a config dataclass is finite and within its `_LOWER_BOUNDS`."""
    for name, tp in typing.get_type_hints(type(obj)).items():
        base, _ = _resolve_type(tp)
        value = getattr(obj, name)
        if base not in (int, float) or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        _check(math.isfinite(value), f"{prefix}{name}={value!r} must be a finite number")
        default = (1, False) if base is int else (0, False)
        bound, strict = _LOWER_BOUNDS.get(f"{type(obj).__name__}.{name}", default)
        _check(
            value > bound if strict else value >= bound,
            f"{prefix}{name}={value!r} must be {'>' if strict else '>='} {bound}",
        )


def _resolve_type(tp: Any) -> tuple[Any, bool]:
    """(base type, optional) of a config field's annotation (`X | None` -> X, True)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False
