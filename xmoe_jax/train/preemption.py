"""Preemption: on a stop signal, finish the step in flight, save, and exit with status 75.

Clusters end jobs with a signal and kill them a little later (SLURM: SIGTERM, or the signal
chosen with `--signal`, then SIGKILL after KillWait). The signals named in `train.stop_signals`
(default SIGTERM, SIGINT, SIGUSR1) become an orderly stop:
  1. the handler only records the signal; a second one during the stop is logged (once) and
     changes nothing, so it cannot interrupt the save. After `ignore_after_stop()` (the CLI calls
     it), from the moment a stop begins the stop signals stay ignored for the rest of the process
     instead of getting their previous action back, so a late one cannot turn status 75 into
     death by signal (143) and leave `run.lock` behind;
  2. after each step the loop asks `StopSignals.stop_now(step)`. With several processes the
     answer is a collective: the maximum of every process's flag, computed on device right after
     step s and read after step s + 1 (when the loop waits for that step's metrics anyway), so
     every process stops after the same step even if only one was signalled, and no step waits
     for the decision;
  3. the loop then saves that step synchronously (model, optimizer state, router biases, data
     position, RNG; unless its regular save is already under way), waits for it, logs one line
     naming the step and how to resume, and raises `Preempted`; `xmoe-train` exits with
     `PREEMPTED_EXIT_CODE`, which the SLURM scripts answer with a requeue.
JAX's own preemption sync (`multihost_utils.reached_preemption_sync_point`) is not used: it hears
SIGTERM only and needs `jax.distributed`; the collective above covers any signal and one process.

Before the first step has run (restoring, compiling: minutes on a GPU) there is nothing to save, and
Python would run the handler only when XLA's compiler returns. A program that exits on a stop (the
CLI, `ignore_after_stop`) therefore stops at once there instead (`_BeforeFirstStep`): the loop's
cleanup (the run lock, an empty metrics.jsonl), one line, status 75; the run directory is left as
the same command starts or resumes it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmoe_jax.config.signals import stop_signal_names

if TYPE_CHECKING:
    from jax.sharding import Mesh

# JAX is imported where a running stop needs it: reading `PREEMPTED_EXIT_CODE` (launch scripts,
# tests) must not start JAX.

log = logging.getLogger("xmoe_jax")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request, saved; run again to continue


class Preempted(Exception):
    """The run stopped on a signal after `step`; `saved_step` is the checkpoint to resume from."""

    def __init__(self, signal_name: str, step: int, saved_step: int | None, checkpoint_dir: Path):
        self.signal_name, self.step, self.saved_step = signal_name, step, saved_step
        if saved_step is None:
            where = "nothing saved (checkpoint.enabled=false): a new run starts from step 0"
        else:
            where = f"checkpoint step {saved_step} saved in {checkpoint_dir}; continue with --resume"
        super().__init__(
            f"stopped by {signal_name} after step {step}: {where} (exit status {PREEMPTED_EXIT_CODE})"
        )


_ignore_after_stop = False


def ignore_after_stop() -> None:
    """From the moment a stop begins, ignore the stop signals for the rest of this process rather
    than restoring their previous action when `train()` returns: for a program that exits once
    `train()` raises `Preempted` (the CLI). Signal dispositions are the process's, hence a switch
    here rather than a `train()` argument."""
    global _ignore_after_stop
    _ignore_after_stop = True


@contextlib.contextmanager
def ignoring_after_stop():
    """`ignore_after_stop()` for the calls inside the block only (the CLI's `train()`); the switch
    is put back after it, so a later `train()` in the same process (tests, notebooks) restores the
    handlers it found. Dispositions already set to ignored stay so: the process is about to exit."""
    global _ignore_after_stop
    before = _ignore_after_stop
    _ignore_after_stop = True
    try:
        yield
    finally:
        _ignore_after_stop = before


def _leave(code: int) -> None:
    """Ends the process at once (a test replaces it): the main thread may be inside XLA's compiler."""
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _BeforeFirstStep:
    """Until `disarm()`, a stop signal runs `on_stop(signal name)` at once, on a thread of its own.

    Python runs a signal's handler on the main thread between bytecodes only, and before the first
    step the main thread is in XLA's compiler. The C-level handler writes the signal's number to a
    wakeup fd (`signal.set_wakeup_fd`) at once, though: this thread reads it. `on_stop` does not
    return (it leaves the process); a signal that comes after `disarm()` is the orderly stop's."""

    def __init__(self, signals: list[signal.Signals], on_stop: Callable[[str], None]):
        self._numbers = {int(s) for s in signals}
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self.armed = True
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="xmoe-stop-before-step-1", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while data := os.read(self._read, 64):  # b"": disarmed
            numbers = [n for n in data if n in self._numbers]
            if numbers:
                with self._lock:
                    if self.armed:
                        self._on_stop(signal.Signals(numbers[0]).name)
                    return

    def disarm(self) -> None:
        """From the main thread (it puts the wakeup fd back): signals go to the orderly stop now."""
        with self._lock:  # a stop under way holds it until the process has left
            if not self.armed:
                return
            self.armed = False
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)
        self._thread.join(timeout=5)
        os.close(self._read)


class StopSignals:
    """Turns the signals of `train.stop_signals` into a stop after a step every process agrees on.

    Use as a context manager around the loop: it installs the handlers (from the main thread only;
    elsewhere it logs that signals keep their default action) and restores the previous ones. With
    `before_first_step` (the loop's cleanup) and `ignore_after_stop()` in effect, a stop signal that
    comes before `first_step_done()` ends the process at once, with status 75 (`_BeforeFirstStep`).
    """

    def __init__(self, names: str, mesh: Mesh, before_first_step: Callable[[], None] | None = None):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        self.signals = [signal.Signals[n] for n in stop_signal_names(names)]
        self.received: str | None = None
        self.stopping = False
        self._repeats = -1  # signals after the first
        self._previous: dict[signal.Signals, Any] = {}
        self._cleanup = before_first_step
        self._early: _BeforeFirstStep | None = None
        self._multi = jax.process_count() > 1
        if self._multi:
            self._mesh = mesh
            self._flags = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
            self._any = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))
            self._decision: jax.Array | None = None  # the collective dispatched after the last step

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                log.info("train() runs outside the main thread: %s keep their default action", self.signals)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.signals and self._cleanup is not None and _ignore_after_stop:
            self._early = _BeforeFirstStep(self.signals, self._stop_before_first_step)
        return self

    def first_step_done(self) -> None:
        """From here on a stop signal stops after a step, saving it (call once the first step ran)."""
        if self._early is not None:
            self._early.disarm()

    def _stop_before_first_step(self, name: str) -> None:
        self.received = name
        with contextlib.suppress(Exception):  # leaving matters more than tidying
            self._cleanup()
        log.warning(
            "stopped by %s before the first step: nothing new saved; run the same command to start again "
            "(exit status %d)",
            name,
            PREEMPTED_EXIT_CODE,
        )
        _leave(PREEMPTED_EXIT_CODE)

    def __exit__(self, *exc: object) -> None:
        self.first_step_done()
        stopped = self.received is not None or self.stopping
        for sig, previous in self._previous.items():
            if stopped and _ignore_after_stop:
                previous = signal.SIG_IGN  # the process exits with 75 next: nothing may interrupt that
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._early is not None and self._early.armed:  # `_BeforeFirstStep` stops and says so;
            self.received = self.received or name  # if the first step ends first, the loop stops after it
            return
        self._repeats += 1
        if self.received is None:
            self.received = name
            log.warning("received %s: finishing the step in flight, then saving and stopping", name)
        elif self._repeats == 1:  # once: a storm of signals is one line
            log.warning(
                "received %s again: already stopping (%s)%s; this and further stop signals change "
                "nothing; a SIGKILL now leaves the previous checkpoint as the resume point",
                name,
                self.received,
                ", the checkpoint is being written" if self.stopping else "",
            )

    def stop_now(self, step: int) -> bool:
        """Whether to stop after `step`; the same answer on every process (call after every step)."""
        if not self._multi:
            return self.received is not None
        import jax
        import numpy as np

        flag = np.int32(self.received is not None)
        size = self._mesh.size
        flags = jax.make_array_from_callback(
            (size,), self._flags, lambda index: np.full(len(range(*index[0].indices(size))), flag)
        )
        previous, self._decision = self._decision, self._any(flags)
        return previous is not None and bool(previous)

    def stop(self, step: int, ckpt: Any, state: dict, data_iter: Any, cfg: Any) -> Preempted:
        """Saves `step` synchronously (`ckpt` None: nothing to save) and returns the exception to raise."""
        self.stopping = True
        saved = None
        if ckpt is not None:
            if step not in ckpt.all_steps():  # else its regular save is already under way
                ckpt.save(step, state, data_iter, cfg, force=True)
            ckpt.wait()
            saved = step
        stopped = Preempted(self.received or "a peer's signal", step, saved, getattr(ckpt, "directory", None))
        log.warning("%s", stopped)
        return stopped
