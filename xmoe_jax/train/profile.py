"""`train.profile_steps: [first, last]`: a jax.profiler trace of those steps under the run dir.

Why steps of our choosing: the first steps are compilation and warm-up, so a useful trace starts
later and is short (a few steps make a large file). The trace (`plugins/profile/<time>/*.xplane.pb`)
opens in TensorBoard's profile plugin or Perfetto. Each process traces its own devices; with several
processes each writes under `profile/process_<i>`.

The trace starts before step `first` is dispatched and stops after step `last` has finished
(its outputs are waited for), so it holds whole steps.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from xmoe_jax.train.rundir import RunDir

log = logging.getLogger("xmoe_jax")


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, run_dir: Path):
        self._steps = steps
        base = RunDir(run_dir).profile
        self.directory = base if jax.process_count() == 1 else base / f"process_{jax.process_index()}"
        self._active = False

    def before_step(self, step: int) -> None:
        if self._steps is None or self._active:
            return
        first, last = self._steps
        if first <= step <= last:  # a resumed run starting inside the range traces the rest of it
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self._active = True

    def after_step(self, step: int, outputs) -> None:
        if self._active and step >= self._steps[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
            log.info("profile of steps %s written to %s", list(self._steps), self.directory)
