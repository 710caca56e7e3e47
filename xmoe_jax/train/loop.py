"""The training loop: validate, build, (resume,) compile, step; logging, evaluation, profiling,
checkpoints and the stop on a signal are hooks (`hooks.py`) called around each step.

Everything that can be wrong with the input (config, devices, data file, run
directory, checkpoint) is checked before anything is compiled. A run directory
that already holds a run is never written over: continue it with `resume=True`
or choose a new `train.run_dir`.

Reliability (docs/reliability.md) enters at marked places: the run directory's
checks and lock, and the metrics trimmed to the resumed step (`rundir`); the resume
from the newest intact checkpoint (`resume.py`); the stop on a signal after a step every
process agrees on (`preemption`, through the stop hook), or at once before the first step, when
there is nothing to save yet (`_tidy_before_first_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import jax
from jax.experimental import multihost_utils

from xmoe_jax import sharding
from xmoe_jax.config import Config, ConfigError
from xmoe_jax.config.applies import check_training_data
from xmoe_jax.data import fingerprint, make_eval_input, make_input, provenance
from xmoe_jax.launch import scan_stacks, xla_flags
from xmoe_jax.resolve import exchange_devices, resolve_placement
from xmoe_jax.train import hooks, runlock
from xmoe_jax.train import resume as tresume
from xmoe_jax.train import state as tstate
from xmoe_jax.train import step as tstep
from xmoe_jax.train.buffers import AdaptiveStep
from xmoe_jax.train.checkpoint import Checkpointer
from xmoe_jax.train.compat import check_compatible
from xmoe_jax.train.errors import TrainingError  # noqa: F401  (what train() raises; imported from here)
from xmoe_jax.train.evaluate import Evaluator
from xmoe_jax.train.metrics import (
    MetricsLogger,
    Throughput,
    flops_per_token,
    peak_tflops,
)
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


def _global_batch(local: dict, shard) -> dict:
    return {k: jax.make_array_from_process_local_data(shard, v) for k, v in local.items()}


def train(
    cfg: Config, *, resume: bool = False, start_if_missing: bool = False, new_data: bool = False
) -> TrainResult:
    """Runs `cfg.train.steps` steps in total (resumed runs continue to that count).

    `resume`: continue from the newest intact checkpoint in `train.run_dir`. With none there, it
    starts at step 0 (and says so), but refuses a `run_dir` that does not exist (a typo must not
    restart a run; `start_if_missing=True` starts one there: a job's first submission) and one whose
    run cannot be continued (see `_check_nothing_to_resume`). A run already at `train.steps`
    returns at once, `already_finished` set. `new_data` (`--new-data`): resume on data other than the
    checkpoint's, from its position 0 (else refused: `data/fingerprint.py`)."""
    # -- validate everything before building or compiling anything
    num_processes, process_index = jax.process_count(), jax.process_index()
    cfg.validate_for_devices(jax.device_count(), num_processes)
    check_training_data(cfg)  # a tokenizer with synthetic data (config/applies.py, `train` row)
    scan_stacks.apply_from_env()  # XMOE_SCAN_STACKS: before any step compiles (a bad value is refused here)
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
    made = ckpt_dir is not None and not ckpt_dir.exists()  # the check below creates it
    lock = runlock.claim(
        run.root, process_index == 0, ckpt_dir
    )  # reliability: writable, one writer at a time
    try:
        return _start(cfg, run, data_iter, resume, eval_data, new_data, lock)
    except ConfigError:  # refused before training (a --resume it cannot continue)
        if made:  # no empty checkpoints/ left behind
            with contextlib.suppress(OSError):
                ckpt_dir.rmdir()  # only if empty
        raise
    finally:
        lock.release()


def _tidy_before_first_step(run: RunDir, lock: runlock.RunLock, is_main: bool):
    """What a stop before the first step leaves undone (`preemption._BeforeFirstStep`): an empty
    metrics.jsonl would make the same command refuse the run directory, and the lock is released.
    config.yaml and the tokenizer's copy stay: the same command writes them again."""

    def tidy() -> None:
        if is_main and run.metrics.is_file() and run.metrics.stat().st_size == 0:
            run.metrics.unlink()
        lock.release()

    return tidy


def _start(
    cfg: Config, run: RunDir, data_iter, resume: bool, eval_data, new_data: bool, lock: runlock.RunLock
) -> TrainResult:
    num_processes, process_index = jax.process_count(), jax.process_index()
    ckpt = Checkpointer(run.checkpoints, cfg.checkpoint) if (cfg.checkpoint.enabled or resume) else None
    candidates = tresume.select(cfg, run, resume, ckpt)
    start = candidates.newest
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
    if ckpt is not None:  # what the data position indexes into: recorded, and checked on resume
        ckpt.data_fingerprint = fingerprint.of_data(cfg.data)
    same_data = start is None or fingerprint.check_resume(
        ckpt.directory, start, ckpt.data_fingerprint, new_data
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
    tidy = _tidy_before_first_step(run, lock, is_main)
    with jax.set_mesh(mesh), StopSignals(cfg.train.stop_signals, mesh, before_first_step=tidy) as stop:
        return _run(cfg, mesh, ckpt, candidates, data_iter, run, is_main, stop, eval_data, same_data)


def _run(
    cfg: Config,
    mesh,
    ckpt,
    candidates,
    data_iter,
    run: RunDir,
    is_main: bool,
    stop,
    eval_data=None,
    same_data=True,
) -> TrainResult:
    placed = resolve_placement(cfg, exchange_devices(mesh))  # steps build on this; cfg is what the run saves
    layout = tstate.build(placed, mesh)
    spec, optimizer, shardings = layout.spec, layout.optimizer, layout.shardings
    start = None
    if not candidates:
        log.info("initialising the parameters...")
        state = layout.init(cfg, mesh)
    else:  # reliability: the newest intact candidate
        restore_iter = data_iter if same_data else None  # new data (--new-data): from its position 0
        start, state = tstate.restore(ckpt, layout, cfg.model.num_dense_layers, candidates, restore_iter)
        log.info("resumed from %s at step %d", run.checkpoints, start)
    if is_main:  # reliability: records of steps a kill lost (they run again) move aside
        run.trim_metrics(start or 0)
    step_fn = AdaptiveStep(placed, optimizer, mesh, shardings)
    if ckpt is not None:  # the buffers' rung travels with each checkpoint, and a resume starts on it
        if start is not None:
            step_fn.ladder.resume(ckpt.restored_run_state, start)
        ckpt.run_state = step_fn.ladder.state
    data_sh = tstep.batch_sharding(mesh, cfg)

    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
    meter = Throughput(
        tokens_per_step, flops_per_token(cfg.model, cfg.train.seq_len), jax.device_count(), peak
    )
    logger = MetricsLogger(run.root, cfg.train.steps, enabled=is_main, tensorboard=cfg.train.tensorboard)
    evaluator = Evaluator.for_training(placed, spec, mesh, shardings, eval_data)  # [eval] None: no eval
    profiler = StepProfiler(cfg.train.profile_steps, run.root)  # [profile]
    xla_flags.check_scheduler(cfg.parallel.xla_scheduler, jax.default_backend())  # warns if not in effect
    loop = hooks.Loop(cfg, state, data_iter, ckpt, meter, logger)
    registered = hooks.standard(cfg, ckpt, stop, evaluator, profiler, step_fn.ladder)  # hooks.py: the table

    first = (start or 0) + 1
    started, first_step_s = time.perf_counter(), None
    log.info("compiling the train step (the first step includes it)...")
    try:
        meter.reset()
        for step in range(first, cfg.train.steps + 1):
            batch = _global_batch(next(data_iter), data_sh)
            for hook in registered:
                hook.before_step(loop, step)
            loop.state, metrics = step_fn(loop.state, batch, step)
            meter.tick()
            if step == first:  # compilation (and the first step) done: say how long it took
                jax.block_until_ready(metrics["loss"])
                first_step_s = time.perf_counter() - started
                log.info("step %d compiled and ran in %.1f s", step, first_step_s)
                meter.compiled()  # throughput counts from here
                stop.first_step_done()  # a stop signal now stops after a step, saving it
            loop.dispatched(step, metrics)  # checks the previous step while this one runs
            logger.progress(step, meter.steps_per_s(), tokens_per_step)
            for hook in registered:
                if hook.due(loop, step):
                    hook.after_step(loop, step, metrics)
        loop.settle()
    finally:
        for hook in registered:
            hook.close(loop)
        logger.close()
        if ckpt is not None:
            try:
                ckpt.wait()  # CheckpointWriteError: one line naming the folder and the step
            finally:
                ckpt.close()
    return TrainResult(
        losses=loop.losses,
        final_step=cfg.train.steps,
        skipped=loop.skipped,
        records=loop.records,
        evals=loop.evals,
        first_step_s=first_step_s,
    )
