"""The training loop: validate, build, (resume,) compile, step, log, checkpoint.

Everything that can be wrong with the input (config, devices, data file, run
directory, checkpoint) is checked before anything is compiled. A run directory
that already holds a run is never written over: continue it with `resume=True`
or choose a new `train.run_dir`.

Reliability (docs/reliability.md) enters at marked places: the run directory's
checks and lock, and the metrics trimmed to the resumed step (`rundir`); the resume
from the newest intact checkpoint (`Checkpointer.resume_candidates` /
`restore_first_intact`); the stop on a signal after a step every process agrees on
(`preemption`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import jax
from jax.experimental import multihost_utils

from xmoe_jax import sharding
from xmoe_jax.config import Config, ConfigError, to_dict
from xmoe_jax.data import make_eval_input, make_input, provenance
from xmoe_jax.launch import xla_flags
from xmoe_jax.resolve import exchange_devices, resolve_placement
from xmoe_jax.train import runlock
from xmoe_jax.train import state as tstate
from xmoe_jax.train import step as tstep
from xmoe_jax.train.buffers import AdaptiveStep
from xmoe_jax.train.checkpoint import Checkpointer, check_compatible
from xmoe_jax.train.errors import TrainingError
from xmoe_jax.train.evaluate import Evaluator
from xmoe_jax.train.metrics import (
    MetricsLogger,
    Throughput,
    exchange_stats,
    expert_stats,
    flops_per_token,
    peak_tflops,
)
from xmoe_jax.train.optimizer import lr_on_host
from xmoe_jax.train.preemption import StopSignals
from xmoe_jax.train.profile import StepProfiler
from xmoe_jax.train.rundir import RunDir

log = logging.getLogger("xmoe_jax")


@dataclasses.dataclass
class TrainResult:
    losses: dict[int, float]  # step -> loss, for every step run in this call
    final_step: int
    skipped: list[int]  # steps not applied (non-finite loss, gradient or update, nan_policy=skip)
    records: list[dict]  # what was logged
    evals: list[dict] = dataclasses.field(default_factory=list)  # eval records (eval.every)
    first_step_s: float | None = None  # wall time of the first step, compilation included
    already_finished: bool = False  # resumed at train.steps: nothing ran


def _prepare_run_dir(cfg: Config, run: RunDir, resume: bool, ckpt: Checkpointer | None) -> list[int]:
    """Returns the steps to resume from, newest first ([] = fresh); refuses to overwrite a run."""
    if resume:  # reliability: only steps whose metadata and manifest check out
        candidates = ckpt.resume_candidates() if ckpt is not None else []
        if not candidates:
            _check_nothing_to_resume(cfg, run)
            log.info("no checkpoint in %s: starting at step 0", run.checkpoints)
        return candidates
    latest = ckpt.latest_step() if ckpt is not None else None
    if latest is not None:
        raise ConfigError(
            f"{run} already holds a run (checkpoint at step {latest}); pass --resume to continue "
            "it or set train.run_dir to a new directory"
        )
    if run.metrics.exists():
        raise ConfigError(
            f"{run} already holds metrics.jsonl from another run; set train.run_dir to a new "
            "directory (or pass --resume to append)"
        )
    return []


def _check_nothing_to_resume(cfg: Config, run: RunDir) -> None:
    """`--resume` found no checkpoint: start at step 0, unless that would write over a run that
    never could be resumed (it saved no checkpoints) or that trained another model."""
    saved = run.read_start_config()
    if saved is None:
        return
    fix = f"set train.run_dir to a new directory, or remove {run} if you no longer need that run"
    if not isinstance(saved, dict):
        return
    if (saved.get("checkpoint") or {}).get("enabled") is False:
        raise ConfigError(
            f"--resume: {run} holds a run that saved no checkpoints (checkpoint.enabled=false), so "
            f"there is nothing to resume, and starting over would write over it; {fix}"
        )
    old = json.loads(json.dumps(saved.get("model") or {}))
    new = json.loads(json.dumps(to_dict(cfg.model)))
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if diff:
        was = ", ".join(f"model.{k}={old.get(k)} there, {new.get(k)} here" for k in diff[:3])
        raise ConfigError(
            f"--resume: {run} holds a run of another model ({was}) and no checkpoint, so starting "
            f"over would write over it; {fix}"
        )


def _last_checkpoint(ckpt: Checkpointer | None) -> str:
    if ckpt is None or not ckpt.cfg.enabled:
        return "; no checkpoints (checkpoint.enabled=false)"
    latest = ckpt.latest_step()
    return f"; last checkpoint: step {latest}" if latest is not None else "; no checkpoint saved yet"


def _global_batch(local: dict, shard) -> dict:
    return {k: jax.make_array_from_process_local_data(shard, v) for k, v in local.items()}


def train(cfg: Config, *, resume: bool = False, start_if_missing: bool = False) -> TrainResult:
    """Runs `cfg.train.steps` steps in total (resumed runs continue to that count).

    `resume`: continue from the newest intact checkpoint in `train.run_dir`. With none there, it
    starts at step 0 (and says so), but refuses a `run_dir` that does not exist (a typo must not
    restart a run; `start_if_missing=True` starts one there: a job's first submission) and one whose
    run cannot be continued (see `_check_nothing_to_resume`). A run already at `train.steps`
    returns at once, `already_finished` set."""
    # -- validate everything before building or compiling anything
    num_processes, process_index = jax.process_count(), jax.process_index()
    cfg.validate_for_devices(jax.device_count(), num_processes)
    cfg = provenance.resolve(cfg)  # data.tokenizer: the data's own, or refused if it differs
    run = RunDir(cfg.train.run_dir)
    if resume and not start_if_missing and not run.root.exists():
        raise ConfigError(
            f"--resume: train.run_dir={run} does not exist, so there is nothing to resume; check the "
            "path, or pass --resume-or-start instead (a first submission of a job that resumes itself)"
        )
    data_iter = make_input(
        cfg.data,
        seq_len=cfg.train.seq_len,
        batch_size=cfg.train.batch_size // num_processes,
        vocab_size=cfg.model.vocab_size,
        process_index=process_index,
        process_count=num_processes,
        holdout=cfg.eval.holdout,
    )
    eval_data = make_eval_input(cfg, process_index=process_index, process_count=num_processes)  # [eval]
    ckpt_dir = run.checkpoints if cfg.checkpoint.enabled else None
    lock = runlock.claim(
        run.root, process_index == 0, ckpt_dir
    )  # reliability: writable, one writer at a time
    try:
        return _start(cfg, run, data_iter, resume, eval_data)
    finally:
        lock.release()


def _start(cfg: Config, run: RunDir, data_iter, resume: bool, eval_data) -> TrainResult:
    num_processes, process_index = jax.process_count(), jax.process_index()
    ckpt = Checkpointer(run.checkpoints, cfg.checkpoint) if (cfg.checkpoint.enabled or resume) else None
    candidates = _prepare_run_dir(cfg, run, resume, ckpt)
    start = candidates[0] if candidates else None
    if start is not None:
        check_compatible(ckpt.read_config(start), cfg)
    if start is not None and start == cfg.train.steps:  # a restart loop's last round: nothing to do
        log.info("already finished: checkpoint step %d in %s is train.steps", start, ckpt.directory)
        ckpt.close()
        return TrainResult(losses={}, final_step=start, skipped=[], records=[], already_finished=True)
    if start is not None and start > cfg.train.steps:
        raise ConfigError(
            f"the checkpoint in {ckpt.directory} is at step {start}, past train.steps={cfg.train.steps}; "
            f"set train.steps to {start} or more"
        )
    if num_processes > 1:  # every process has checked the run directory before any writes to it
        multihost_utils.sync_global_devices("xmoe_jax: run directory checked")
    is_main = process_index == 0
    run.root.mkdir(parents=True, exist_ok=True)
    if is_main and start is None:
        run.write_config(cfg)
    provenance.record(run.tokenizer, cfg.data.tokenizer, write=is_main)  # the run's copy: for the tools

    # -- build
    mesh = sharding.make_mesh(cfg.mesh)
    devices = jax.devices()
    log.info(
        "devices: %d x %s%s; mesh %s",
        len(devices),
        devices[0].device_kind,
        f" in {num_processes} processes" if num_processes > 1 else "",
        " ".join(f"{name}={size}" for name, size in mesh.shape.items()),
    )
    with jax.set_mesh(mesh), StopSignals(cfg.train.stop_signals, mesh) as stop:
        return _run(cfg, mesh, ckpt, candidates, data_iter, run, is_main, stop, eval_data)


def _run(
    cfg: Config, mesh, ckpt, candidates, data_iter, run: RunDir, is_main: bool, stop, eval_data=None
) -> TrainResult:
    placed = resolve_placement(cfg, exchange_devices(mesh))  # steps build on this; cfg is what the run saves
    layout = tstate.build(placed, mesh)
    spec, optimizer, shardings = layout.spec, layout.optimizer, layout.shardings
    start = None
    if not candidates:
        log.info("initialising the parameters...")
        state = layout.init(cfg, mesh)
    else:  # reliability: the newest intact candidate
        start, state = tstate.restore(ckpt, layout, cfg.model.num_dense_layers, candidates, data_iter)
        log.info("resumed from %s at step %d", run.checkpoints, start)
    if is_main:  # reliability: records of steps a kill lost (they run again) move aside
        run.trim_metrics(start or 0)
    step_fn = AdaptiveStep(placed, optimizer, mesh, shardings)
    ladder = step_fn.ladder
    data_sh = tstep.batch_sharding(mesh, cfg)
    lr_at = lr_on_host(cfg.optimizer, cfg.train.steps)  # no JAX op: nothing to compile while logging

    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
    meter = Throughput(
        tokens_per_step, flops_per_token(cfg.model, cfg.train.seq_len), jax.device_count(), peak
    )
    logger = MetricsLogger(run.root, cfg.train.steps, enabled=is_main, tensorboard=cfg.train.tensorboard)
    evaluator = Evaluator.for_training(placed, spec, mesh, shardings, eval_data)  # [eval] None: no eval
    profiler = StepProfiler(cfg.train.profile_steps, run.root)  # [profile]
    xla_flags.check_scheduler(cfg.parallel.xla_scheduler, jax.default_backend())  # warns if not in effect
    losses: dict[int, float] = {}
    records: list[dict] = []
    evals: list[dict] = []
    skipped: list[int] = []

    def check(step: int, metrics: dict) -> None:
        loss = float(metrics["loss"])
        losses[step] = loss
        if not bool(metrics["finite"]):
            msg = (
                f"non-finite loss ({loss}), gradient or update at step {step}; this step was not applied. "
                "Lower optimizer.lr, raise optimizer.warmup_steps, or set train.nan_policy=skip"
            )
            if cfg.train.nan_policy == "stop":
                raise TrainingError(msg + _last_checkpoint(ckpt))
            skipped.append(step)
            log.warning("skipped: %s", msg)
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

    first = (start or 0) + 1
    pending: tuple[int, dict] | None = None
    started, first_step_s = time.perf_counter(), None
    log.info("compiling the train step (the first step includes it)...")
    try:
        meter.reset()
        saving = ckpt is not None and cfg.checkpoint.enabled
        for step in range(first, cfg.train.steps + 1):
            if saving and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps):
                ckpt.wait()  # reliability: the previous save is on disk before the next is due, so a kill
                # at any moment loses fewer than 2 * checkpoint.every steps (docs/reliability.md)
            batch = _global_batch(next(data_iter), data_sh)
            profiler.before_step(step)  # [profile]
            state, metrics = step_fn(state, batch, step)
            profiler.after_step(step, metrics)  # [profile]
            meter.tick()
            if step == first:  # compilation (and the first step) done: say how long it took
                jax.block_until_ready(metrics["loss"])
                first_step_s = time.perf_counter() - started
                log.info("step %d compiled and ran in %.1f s", step, first_step_s)
                meter.compiled()  # throughput counts from here
            if pending is not None:  # check the previous step while this one runs
                check(*pending)
            pending = (step, metrics)
            logger.progress(step, meter.steps_per_s(), tokens_per_step)
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                check(*pending)
                pending = None
                record = {
                    "step": step,
                    "loss": losses[step],
                    "ce": float(metrics["ce"]),
                    "aux_loss": float(metrics["aux_loss"]),
                    "z_loss": float(metrics["z_loss"]),
                    "grad_norm": float(metrics["grad_norm"]),
                    "lr": lr_at(step - 1),
                    **meter.read(),
                }
                steps_per_s = record["tokens_per_s"] / tokens_per_step
                steady = steps_per_s > 0 and not record.get("includes_compile")
                eta_s = (cfg.train.steps - step) / steps_per_s if steady else None
                if "mtp_loss" in metrics:
                    record["mtp_loss"] = float(metrics["mtp_loss"])
                if "tokens_per_expert" in metrics:
                    record.update(
                        expert_stats(
                            metrics["tokens_per_expert"], metrics["drop_rate"], metrics.get("recv_rows")
                        )
                    )
                if "wire_bytes" in metrics:
                    record.update(exchange_stats(metrics, ladder))
                records.append(record)
                logger.log(record, eta_s)
            if evaluator is not None and evaluator.due(step, cfg.train.steps):  # [eval]
                evals.append(evaluator.run(state, step))
                logger.log(evals[-1])
                meter.reset()  # eval time is not training throughput
            final = step == cfg.train.steps
            if ckpt is not None and cfg.checkpoint.enabled and ckpt.due(step, final):
                if pending is not None:  # never save a step before it is known to be good
                    check(*pending)
                    pending = None
                with meter.paused():  # saving is not training throughput
                    ckpt.save(step, state.as_dict(), data_iter, cfg, force=final)
            if step < cfg.train.steps and stop.stop_now(step):  # reliability: the same step everywhere
                if pending is not None:
                    check(*pending)
                raise stop.stop(
                    step, ckpt if cfg.checkpoint.enabled else None, state.as_dict(), data_iter, cfg
                )
        if pending is not None:
            check(*pending)
    finally:
        profiler.close()
        logger.close()
        if ckpt is not None:
            try:
                ckpt.wait()  # CheckpointWriteError: one line naming the folder and the step
            finally:
                ckpt.close()
    return TrainResult(
        losses=losses,
        final_step=cfg.train.steps,
        skipped=skipped,
        records=records,
        evals=evals,
        first_step_s=first_step_s,
    )
