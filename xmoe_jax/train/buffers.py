"""Receive buffers that size themselves: exact dropless training without worst-case memory.

`AdaptiveStep` runs the train step on the buffer ladder's current rung (moe/ladder.py: the
rungs, when to grow and when to shrink) and compiles one step per rung it visits (cached). A
step with copies that did not fit is never applied (the step's guard keeps params, optimizer,
biases, step and RNG) and runs again on the rung the ladder grows to, so no copy is ever
dropped and the losses are those of a run with big enough buffers.

Applies to dropless pft/rbd on more than one device (`parallel.adaptive_buffers`).

A transport whose buffers only grow (its record's `buffers_shrink` is False: push) starts on the
ladder's first rung too. Starting at the worst case instead (no overflow, nothing recompiles) was
measured slower at full depth: 81.7k against 88.6k tokens/s on 4x H200 at 28 layers, with a
123.4 GiB peak against 104.6 (benchmarks/exchange.md). `parallel.adaptive_buffers=false` with
no factor still gives that one worst-case buffer to whoever wants no recompile at all.
"""

from __future__ import annotations

import logging

import jax

from xmoe_jax import sharding
from xmoe_jax.config import Config, ParallelConfig
from xmoe_jax.launch import distributed
from xmoe_jax.moe.ladder import BufferLadder, applies
from xmoe_jax.train import headroom
from xmoe_jax.train.errors import TrainingError

log = logging.getLogger("xmoe_jax")


class AdaptiveStep:
    """step(state, batch, step_number) -> (state, metrics): the train step on the ladder's current
    rung; a step that overflowed runs again on a bigger rung (synchronously: the overflow count is
    read after every step while the ladder is active)."""

    def __init__(self, cfg: Config, optimizer, mesh, shardings):
        self.cfg, self.optimizer, self.mesh, self.shardings = cfg, optimizer, mesh, shardings
        exchange_devices = sharding.axis_size(mesh, sharding.EXPERT_AXES)
        self.ladder = BufferLadder(cfg.parallel, applies(cfg, exchange_devices), peers=exchange_devices)
        self._compiled: dict = {}
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

    def __call__(self, state, batch: dict, step: int):
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
