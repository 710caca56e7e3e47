"""Evaluation: mean cross-entropy and perplexity on held-out batches, in a run or from a checkpoint.

Why a separate jitted step: evaluation needs the loss only (no gradient, no optimizer, no donated
state), so it is its own small function, compiled once on the train step's shardings; the train
step is never retraced. Every evaluation reads the same `eval.steps` batches from the start
(`data.make_eval_input`), so its numbers compare over a run and with `xmoe-eval` on a checkpoint.

eval_loss = mean over batches of the mean token cross-entropy (batches have equal size);
eval_ppl = exp(eval_loss).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import grain
import jax
from jax.sharding import NamedSharding, PartitionSpec

from xmoe_jax import sharding
from xmoe_jax.config import Config, ConfigError
from xmoe_jax.data import make_eval_input, provenance
from xmoe_jax.launch import distributed
from xmoe_jax.model import functional as fmodel
from xmoe_jax.resolve import exchange_devices, resolve_placement
from xmoe_jax.train import step as tstep
from xmoe_jax.train.state import TrainState

log = logging.getLogger("xmoe_jax")


def make_eval_step(spec: fmodel.ModelSpec, cfg: Config, mesh, shardings: TrainState):
    """jit(params, bias, batch) -> mean token cross-entropy (replicated scalar).

    Evaluation never drops a routed copy: pft/rbd receive buffers are the worst case here
    (the training buffer ladder does not apply to a step that is not retried)."""
    if spec.parallel.recv_buffer_factor is not None and spec.cfg.moe is not None:
        spec = fmodel.model_spec(spec.cfg, dataclasses.replace(spec.parallel, recv_buffer_factor=None))

    def eval_step(params, bias, batch):
        return fmodel.loss(spec, params, bias, batch["inputs"], batch["targets"])[0]

    data_sh = tstep.batch_sharding(mesh, cfg)
    return jax.jit(
        eval_step,
        in_shardings=(shardings.params, shardings.bias, {"inputs": data_sh, "targets": data_sh}),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )


class Evaluator:
    """The eval batches and the compiled eval step of one run."""

    def __init__(self, batches: grain.MapDataset, spec, cfg: Config, mesh, shardings: TrainState) -> None:
        self._batches = batches
        self._every = cfg.eval.every
        self._step_fn = make_eval_step(spec, cfg, mesh, shardings)
        self._compiled = None  # _step_fn, compiled on the first run (distributed.compiled_together)
        self._data_sh = tstep.batch_sharding(mesh, cfg)
        self._tokens = cfg.train.batch_size * cfg.train.seq_len * len(batches)

    @classmethod
    def for_training(cls, cfg: Config, spec, mesh, shardings, batches) -> Evaluator | None:
        """None unless the run evaluates (`eval.every` > 0)."""
        return cls(batches, spec, cfg, mesh, shardings) if cfg.eval.every and batches is not None else None

    def due(self, step: int, last_step: int) -> bool:
        return step % self._every == 0 or step == last_step

    def run(self, state: TrainState, step: int) -> dict:
        """{"step", "eval_loss", "eval_ppl", "eval_tokens"} for the state's parameters."""
        losses = []
        for i in range(len(self._batches)):
            local = self._batches[i]
            batch = {k: jax.make_array_from_process_local_data(self._data_sh, v) for k, v in local.items()}
            if self._compiled is None:  # several processes: all compiled before any runs a collective
                self._compiled = distributed.compiled_together(
                    self._step_fn, "eval-step", state.params, state.bias, batch
                )
            losses.append(self._compiled(state.params, state.bias, batch))
        loss = sum(float(x) for x in losses) / len(losses)
        return {
            "step": step,
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 700.0)),  # exp overflows past ~709
            "eval_tokens": self._tokens,
        }


def evaluate_checkpoint(
    run_dir: str | Path, step: int | None = None, overrides: list[str] | None = None
) -> dict:
    """Evaluates the checkpoint at `step` (latest if None) of a run on the run's eval data
    (its `eval:` section with `overrides` applied; an `eval.data.*` override replaces the run's
    held-out split) with the run's tokenizer (`provenance.for_tools`). Writes nothing."""
    from xmoe_jax.train import state as tstate
    from xmoe_jax.train.compat import check_compatible
    from xmoe_jax.train.rundir import RunDir

    run = RunDir(run_dir)
    if not run.config.is_file():
        raise ConfigError(f"{run} holds no config.yaml; pass the run directory xmoe-train wrote (--run-dir)")
    if not run.checkpoints.is_dir():
        raise ConfigError(f"{run} holds no checkpoints/; train with checkpoint.enabled=true")
    overrides = list(overrides or [])
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    if any(k.startswith("eval.data") for k in keys) and "eval.holdout" not in keys:
        overrides.insert(0, "eval.holdout=0")  # other data replaces the run's held-out split
    cfg, step = run.config_at(step, overrides)  # the config that step was written under
    cfg = provenance.for_tools(run.tokenizer, cfg, overrides)  # the run's tokenizer
    cfg.validate_for_devices(jax.device_count(), jax.process_count())
    batches = make_eval_input(cfg, process_index=jax.process_index(), process_count=jax.process_count())
    if batches is None:
        raise ConfigError(
            f"the run in {run} has no eval data (eval.holdout=0, no eval.data); pass "
            "--set eval.data.path=<dataset> or --set eval.holdout=<fraction>"
        )
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh), run.checkpointer(cfg) as ckpt:
        saved = ckpt.saved_config(step)
        if saved is not None:  # a --set model.* must not make other parameters
            check_compatible(saved, cfg)
        cfg = resolve_placement(cfg, exchange_devices(mesh))
        layout = dataclasses.replace(tstate.build(cfg, mesh), copy=None)  # eval reads the masters: no copies
        _, state = tstate.restore(ckpt, layout, cfg.model.num_dense_layers, step)
        spec, shardings = layout.spec, layout.shardings
        return Evaluator(batches, spec, cfg, mesh, shardings).run(state, step)
