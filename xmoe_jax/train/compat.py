"""Whether a checkpoint may continue under this config: only a model config that makes other
parameters (paths, shapes, dtypes) is refused.

Asked before anything is restored or compiled: by the trainer on `--resume` (`loop.py`) and by
`xmoe-eval` (`evaluate.py`) when `--set model.*` overrides the saved config.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax

from xmoe_jax.config import Config, ConfigError, ModelConfig, from_dict, migrate_dict, to_dict
from xmoe_jax.train.checkpoint import CheckpointError
from xmoe_jax.train.integrity import path_str as _path_str

log = logging.getLogger("xmoe_jax")


def _flatten_dotted(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten_dotted(v, f"{prefix}.{k}"))
        return out
    return {prefix: tree}


_MISSING = "<absent>"


def _param_layout(model: ModelConfig) -> dict[str, tuple]:
    """Path -> (shape, dtype) of every parameter and router bias the model config makes."""
    from xmoe_jax.model.functional import model_spec  # the model is only needed on resume

    spec = model_spec(model)
    trees = {"params": spec.params_shape, "bias": spec.bias_shape}
    leaves = jax.tree_util.tree_flatten_with_path(trees)[0]
    return {_path_str(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}


def check_compatible(saved: dict, config: Config) -> None:
    """Raises `CheckpointError` if the saved model config makes other parameters than `config.model`.

    Only what changes the parameters (their paths, shapes or dtypes) is refused, with the differing
    `model.*` keys named. Other model changes (top_k, capacity, losses, dtypes of compute) are
    allowed and logged; train, optimizer, checkpoint, data, mesh and parallel (dispatch mode,
    placement) may change freely: a mesh change is resharded on restore. Configs saved before the
    `parallel` section existed are read with their placement keys moved there.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise CheckpointError(
            "the saved config has no 'model' section, so it cannot be checked against this run; "
            "use a checkpoint written by xmoe_jax or a new train.run_dir"
        )
    saved = migrate_dict(saved)
    # A JSON round trip makes the current config comparable with the saved one (tuples -> lists).
    current = json.loads(json.dumps(to_dict(config.model)))
    old = _flatten_dotted(saved["model"], "model")
    new = _flatten_dotted(current, "model")
    diff = [k for k in sorted(old.keys() | new.keys()) if old.get(k, _MISSING) != new.get(k, _MISSING)]
    if not diff:
        return
    was = ", ".join(f"{k}={old.get(k, _MISSING)}" for k in diff)
    now = ", ".join(f"{k}={new.get(k, _MISSING)}" for k in diff)
    try:
        saved_model = from_dict(saved["model"], ModelConfig)
    except ConfigError as e:
        raise CheckpointError(
            f"the checkpoint's model config cannot be read by this version ({e}); "
            "use the version that wrote it, or a new train.run_dir"
        ) from e
    if _param_layout(saved_model) != _param_layout(config.model):
        raise CheckpointError(
            f"checkpoint was written with {was}, this run has {now}: the parameters differ; "
            "use the same model config or a new train.run_dir"
        )
    log.warning("resuming with a changed model config (parameters unchanged): was %s, now %s", was, now)
