"""The loop's features as hooks, each registered with its cadence.

The loop itself (`loop._run`) only runs steps: fetch a batch, dispatch the step, check the
previous step's metrics while this one runs (`Loop.dispatched`). Everything else is a hook,
called in registration order (`standard`):

    hook      before a step              after a step, when due
    profile   start the trace            stop it after the range's last step    train.profile_steps
    log       -                          one metrics record                      train.log_every, last step
    eval      -                          held-out loss, logged                   eval.every, last step
    save      wait for the previous save a checkpoint of this step               checkpoint.every, last step
    stop      -                          save and raise `Preempted`              any step but the last, on a signal

A hook that needs its step's metrics known good (log, save, stop) calls `Loop.settle()` first: a
step is never logged, saved or stopped at before its non-finite or overflow check. A new feature
adds a hook here, not a branch in the loop.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from xmoe_jax.config import Config
from xmoe_jax.train.checkpoint import Checkpointer
from xmoe_jax.train.errors import TrainingError
from xmoe_jax.train.evaluate import Evaluator
from xmoe_jax.train.metrics import MetricsLogger, Throughput, exchange_stats, expert_stats
from xmoe_jax.train.optimizer import lr_on_host
from xmoe_jax.train.preemption import StopSignals
from xmoe_jax.train.profile import StepProfiler
from xmoe_jax.train.state import TrainState

log = logging.getLogger("xmoe_jax")


def _last_checkpoint(ckpt: Checkpointer | None) -> str:
    if ckpt is None or not ckpt.cfg.enabled:
        return "; no checkpoints (checkpoint.enabled=false)"
    latest = ckpt.latest_step()
    return f"; last checkpoint: step {latest}" if latest is not None else "; no checkpoint saved yet"


def on_cadence(step: int, every: int, last: int) -> bool:
    """Every `every` steps, and the last step."""
    return step % every == 0 or step == last


@dataclasses.dataclass
class Loop:
    """What the hooks see of a running loop: the state after the latest step, the input, the
    checkpointer, the meters, and what the run has recorded so far."""

    cfg: Config
    state: TrainState
    data_iter: Any
    ckpt: Checkpointer | None
    meter: Throughput
    logger: MetricsLogger
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    skipped: list[int] = dataclasses.field(default_factory=list)
    records: list[dict] = dataclasses.field(default_factory=list)
    evals: list[dict] = dataclasses.field(default_factory=list)
    pending: tuple[int, dict] | None = None  # the latest step, its metrics not checked yet

    @property
    def last(self) -> int:
        return self.cfg.train.steps

    def check(self, step: int, metrics: dict) -> None:
        """The step guard: a non-finite step stops the run (or is recorded as skipped), and routed
        copies that overflowed the receive buffers stop a dropless run."""
        cfg = self.cfg
        loss = float(metrics["loss"])
        self.losses[step] = loss
        if not bool(metrics["finite"]):
            msg = (
                f"non-finite loss ({loss}), gradient or update at step {step}; this step was not applied. "
                "Lower optimizer.lr or raise optimizer.warmup_steps"
            )
            if cfg.train.nan_policy == "stop":
                raise TrainingError(f"{msg}, or set train.nan_policy=skip{_last_checkpoint(self.ckpt)}")
            self.skipped.append(step)
            log.warning("skipped: %s (train.nan_policy=skip)", msg)
        overflow = int(metrics.get("num_overflow", 0))
        if overflow:
            msg = (
                f"step {step}: {overflow} routed token copies did not fit the receive buffers "
                f"(parallel.recv_buffer_factor={cfg.parallel.recv_buffer_factor})"
            )
            if cfg.model.moe.capacity_factor is None:  # dropless promises no loss: the step was not applied
                raise TrainingError(
                    f"{msg}; the step was not applied. Set parallel.adaptive_buffers=true (buffers grow as "
                    "needed), raise parallel.recv_buffer_factor, or set it to null for the worst case"
                )
            log.warning("%s; they were counted as dropped", msg)

    def dispatched(self, step: int, metrics: dict) -> None:
        """`step` is running: check the previous one meanwhile (it is done by now)."""
        if self.pending is not None:
            self.check(*self.pending)
        self.pending = (step, metrics)

    def settle(self) -> None:
        """Checks the latest step now (its metrics are waited for)."""
        if self.pending is not None:
            self.check(*self.pending)
            self.pending = None


class Hook:
    """A feature of the loop. `due` is its cadence; `after_step` runs only when it is due."""

    def before_step(self, loop: Loop, step: int) -> None:
        pass

    def due(self, loop: Loop, step: int) -> bool:
        return True

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        pass

    def close(self, loop: Loop) -> None:
        pass


class ProfileHook(Hook):
    """[profile] A trace of `train.profile_steps` (`StepProfiler`)."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def before_step(self, loop: Loop, step: int) -> None:
        self.profiler.before_step(step)

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        self.profiler.after_step(step, metrics)

    def close(self, loop: Loop) -> None:
        self.profiler.close()


class LogHook(Hook):
    """One metrics record every `train.log_every` steps and at the last."""

    def __init__(self, cfg: Config, ladder: Any):
        self.every, self.ladder = cfg.train.log_every, ladder
        self.lr_at = lr_on_host(cfg.optimizer, cfg.train.steps)  # no JAX op: nothing to compile while logging
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len

    def due(self, loop: Loop, step: int) -> bool:
        return on_cadence(step, self.every, loop.last)

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        loop.settle()
        record = {
            "step": step,
            "loss": loop.losses[step],
            "ce": float(metrics["ce"]),
            "aux_loss": float(metrics["aux_loss"]),
            "z_loss": float(metrics["z_loss"]),
            "grad_norm": float(metrics["grad_norm"]),
            "lr": self.lr_at(step - 1),
            **loop.meter.read(),
        }
        steps_per_s = record["tokens_per_s"] / self.tokens_per_step
        steady = steps_per_s > 0 and not record.get("includes_compile")
        eta_s = (loop.last - step) / steps_per_s if steady else None
        if "mtp_loss" in metrics:
            record["mtp_loss"] = float(metrics["mtp_loss"])
        if "tokens_per_expert" in metrics:
            record.update(
                expert_stats(metrics["tokens_per_expert"], metrics["drop_rate"], metrics.get("recv_rows"))
            )
        if "wire_bytes" in metrics:
            record.update(exchange_stats(metrics, self.ladder))
        loop.records.append(record)
        loop.logger.log(record, eta_s)


class EvalHook(Hook):
    """[eval] Held-out loss every `eval.every` steps and at the last."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator

    def due(self, loop: Loop, step: int) -> bool:
        return self.evaluator.due(step, loop.last)

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        loop.evals.append(self.evaluator.run(loop.state, step))
        loop.logger.log(loop.evals[-1])
        loop.meter.reset()  # eval time is not training throughput


class SaveHook(Hook):
    """A checkpoint every `checkpoint.every` steps and at the last."""

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def before_step(self, loop: Loop, step: int) -> None:
        if on_cadence(step, self.ckpt.cfg.every, loop.last):
            self.ckpt.wait()  # reliability: the previous save is on disk before the next is due, so a kill
            # at any moment loses fewer than 2 * checkpoint.every steps (docs/reliability.md)

    def due(self, loop: Loop, step: int) -> bool:
        return self.ckpt.due(step, step == loop.last)

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        loop.settle()  # never save a step before it is known to be good
        with loop.meter.paused():  # saving is not training throughput
            self.ckpt.save(step, loop.state.as_dict(), loop.data_iter, loop.cfg, force=step == loop.last)


class StopHook(Hook):
    """Reliability: on a stop signal, save and raise `Preempted` after the same step everywhere."""

    def __init__(self, stop: StopSignals, ckpt: Checkpointer | None):
        self.stop, self.ckpt = stop, ckpt

    def due(self, loop: Loop, step: int) -> bool:
        return step < loop.last and self.stop.stop_now(step)  # a collective: asked after every step

    def after_step(self, loop: Loop, step: int, metrics: dict) -> None:
        loop.settle()
        raise self.stop.stop(step, self.ckpt, loop.state.as_dict(), loop.data_iter, loop.cfg)


def standard(
    cfg: Config, ckpt: Checkpointer | None, stop: StopSignals, evaluator: Evaluator | None, profiler, ladder
) -> list[Hook]:
    """The trainer's hooks, in the order they run after a step."""
    saving = ckpt if cfg.checkpoint.enabled else None
    hooks: list[Hook] = [ProfileHook(profiler), LogHook(cfg, ladder)]
    if evaluator is not None:
        hooks.append(EvalHook(evaluator))
    if saving is not None:
        hooks.append(SaveHook(saving))
    hooks.append(StopHook(stop, saving))
    return hooks
