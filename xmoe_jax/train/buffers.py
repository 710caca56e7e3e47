"""Receive buffers that size themselves: exact dropless training without worst-case memory.

`AdaptiveStep` runs the train step on the buffer ladder's current rung (moe/ladder.py: the
rungs, when to grow and when to shrink) and compiles one step per rung it visits (cached). A
step with copies that did not fit is never applied (the step's guard keeps params, optimizer,
biases, step and RNG) and runs again on the rung the ladder grows to, so no copy is ever
dropped and the losses are those of a run with big enough buffers.

Applies to dropless pft/rbd on more than one device (`parallel.adaptive_buffers`).

A transport that keeps one receive buffer per run (its record's `buffers_shrink` is False: push)
is sized once where it can be: unless `parallel.recv_buffer_factor` names a start, the first
step compiles at the worst case and, if that step's memory (XLA's own figure: arguments +
temporaries + outputs - donated) fits the device's pool with `FIT` to spare, the run stays there:
no copy can overflow, so no step reruns and nothing recompiles. Otherwise that compile is dropped
and the ladder starts at its usual rung. One process only (every process must decide alike).
"""

from __future__ import annotations

import logging

import jax

from xmoe_jax import sharding
from xmoe_jax.config import Config, ParallelConfig
from xmoe_jax.launch import distributed
from xmoe_jax.moe.ladder import BufferLadder, applies
from xmoe_jax.plan import compiled_peak
from xmoe_jax.train import headroom
from xmoe_jax.train.errors import TrainingError

log = logging.getLogger("xmoe_jax")
FIT = 0.95  # a worst-case step is kept when it needs at most this share of the device's pool


class AdaptiveStep:
    """step(state, batch, step_number) -> (state, metrics): the train step on the ladder's current
    rung; a step that overflowed runs again on a bigger rung (synchronously: the overflow count is
    read after every step while the ladder is active)."""

    def __init__(self, cfg: Config, optimizer, mesh, shardings):
        self.cfg, self.optimizer, self.mesh, self.shardings = cfg, optimizer, mesh, shardings
        exchange_devices = sharding.axis_size(mesh, sharding.EXPERT_AXES)
        self.ladder = BufferLadder(cfg.parallel, applies(cfg, exchange_devices))
        self._compiled: dict = {}
        self._sized = False  # whether the one-buffer start (module docstring) was decided
        self._ran: set = set()  # rungs whose compiled step has run once (headroom for its first run)

    def _jitted(self, parallel: ParallelConfig):
        from xmoe_jax.model.functional import model_spec
        from xmoe_jax.train.step import make_train_step

        spec = model_spec(self.cfg.model, parallel)
        return make_train_step(spec, self.optimizer, self.cfg, self.mesh, self.shardings)

    def _fn(self, parallel: ParallelConfig, state, batch: dict):
        key = parallel.recv_buffer_factor
        if key not in self._compiled:  # one compiled step per rung visited
            fn = self._jitted(parallel)
            self._compiled[key] = distributed.compiled_together(fn, f"train-step-{key}", state, batch)
        return self._compiled[key]

    def _size_once(self, state, batch: dict) -> None:
        """A one-buffer transport starts at the worst case where that step fits (module docstring)."""
        self._sized = True
        ladder = self.ladder
        if not (
            ladder.active
            and ladder.shrink_after is None
            and self.cfg.parallel.recv_buffer_factor is None
            and jax.process_count() == 1
        ):
            return
        limit = headroom.device_limit()
        if limit is None:  # CPU: no pool to fit
            return
        worst = ladder.worst_case()
        compiled = self._jitted(worst).lower(state, batch).compile()
        need = compiled_peak(compiled.memory_analysis())
        gib = 2**30
        if need > FIT * limit:
            log.info(
                "receive buffers: the worst case needs %.1f GiB of the device's %.1f GiB; starting at factor %s "
                "and growing on overflow", need / gib, limit / gib, ladder.factor,
            )  # fmt: skip
            return
        ladder.start_at(worst.recv_buffer_factor)
        self._compiled[worst.recv_buffer_factor] = compiled
        log.info(
            "receive buffers: one for the run, the worst case (the step needs %.1f GiB of the device's %.1f GiB): "
            "no copy can overflow, nothing recompiles", need / gib, limit / gib,
        )  # fmt: skip

    def __call__(self, state, batch: dict, step: int):
        if not self._sized:
            self._size_once(state, batch)
        while True:
            # a rung's first run gets headroom under its temporaries (train/headroom.py)
            key = self.ladder.parallel.recv_buffer_factor
            fn = self._fn(self.ladder.parallel, state, batch)
            cushion = headroom.reserve(self.mesh) if key not in self._ran else None
            state, metrics = fn(state, batch)
            headroom.release(cushion, metrics)
            self._ran.add(key)
            if not self.ladder.active:
                return state, metrics
            # the ladder waits for every step anyway: the metrics move to the host now, so no output
            # of this step stays on the devices above its temporaries (train/headroom.py)
            metrics = jax.device_get(metrics)
            overflow, ratio = int(metrics["num_overflow"]), float(metrics["peak_ratio"])
            if not overflow:
                self.ladder.observe(step, ratio)
                return state, metrics
            if self.ladder.factor is None:
                raise TrainingError(f"step {step}: {overflow} copies overflowed worst-case buffers (a bug)")
            old = self.ladder.parallel.recv_buffer_factor
            self.ladder.grow(step, overflow, ratio)
            if self.ladder.shrink_after is None:  # never back to a smaller rung: let its step go
                self._compiled.pop(old, None)
                self._ran.discard(old)
