"""Receive buffers that size themselves: exact dropless training without worst-case memory.

pft and rbd move routed rows through static buffers (moe/layouts.py). Sized for the
worst case they cost memory and wire time in every step; sized near the average they
overflow when routing is uneven. The trainer keeps a small ladder of sizes, in
multiples of the average load:

    1.1  1.25  1.5  2  3  worst case

and compiles one train step per rung it visits (cached). Each step reports how full
its fullest buffer had to be (`peak_ratio`, max over layers and devices: the factor that
would just fit) and how many copies did not fit. A step with copies that did not fit
is never applied (the step's guard keeps params, optimizer, biases, step and RNG) and
runs again on the smallest rung that holds its peak, so no copy is ever dropped and
the losses are those of a run with big enough buffers. After `buffer_shrink_after`
steps in a row whose peak fits the rung below (with 5% to spare), the trainer steps
down one rung. Each change is logged (step, old and new factor, why) and counted.

Applies to dropless pft/rbd on more than one device (`parallel.adaptive_buffers`).
"""

from __future__ import annotations

import dataclasses
import logging

from xmoe_jax import sharding
from xmoe_jax.config import Config, ParallelConfig
from xmoe_jax.moe.dispatchers import exchanges_tokens
from xmoe_jax.train.errors import TrainingError

log = logging.getLogger("xmoe_jax")

RUNGS: tuple[float | None, ...] = (1.1, 1.25, 1.5, 2.0, 3.0, None)  # None: the worst case
DEFAULT_START = 1.25
SHRINK_MARGIN = 0.95


def _rung_index(factor: float | None) -> int:
    """The smallest rung at least `factor` (the worst case for None or past the ladder)."""
    if factor is None:
        return len(RUNGS) - 1
    for i, rung in enumerate(RUNGS[:-1]):
        if factor <= rung + 1e-9:
            return i
    return len(RUNGS) - 1


def rung_for(factor: float | None) -> float | None:
    """The ladder's smallest rung that holds `factor` x the average load (None: the worst case)."""
    return RUNGS[_rung_index(factor)]


def applies(cfg: Config, num_exchange_devices: int) -> bool:
    moe = cfg.model.moe
    return (
        cfg.parallel.adaptive_buffers
        and exchanges_tokens(cfg.parallel.dispatch)
        and moe is not None
        and moe.capacity_factor is None
        and num_exchange_devices > 1
    )


class BufferLadder:
    """Which rung the next step runs on; `grow` after an overflow, `observe` after a step that fit."""

    def __init__(self, parallel: ParallelConfig, active: bool):
        self.active = active
        start = parallel.recv_buffer_factor if parallel.recv_buffer_factor is not None else DEFAULT_START
        self.index = _rung_index(start) if active else -1
        self.base = parallel
        self.shrink_after = parallel.buffer_shrink_after
        self.quiet = 0
        self.changes = 0

    @property
    def factor(self) -> float | None:
        return RUNGS[self.index] if self.active else self.base.recv_buffer_factor

    @property
    def parallel(self) -> ParallelConfig:
        """The placement the current rung compiles with."""
        return dataclasses.replace(self.base, recv_buffer_factor=self.factor) if self.active else self.base

    def grow(self, step: int, overflow: int, peak_ratio: float) -> None:
        """The step overflowed: move to the smallest rung that holds `peak_ratio`."""
        old = self.factor
        self.index = max(self.index + 1, _rung_index(peak_ratio))
        self.changes += 1
        self.quiet = 0
        log.info(
            "step %d: %d routed copies did not fit the receive buffers (factor %s; the fullest needed %.2fx "
            "the average): not applied, running it again with factor %s",
            step, overflow, _name(old), peak_ratio, _name(self.factor),
        )  # fmt: skip

    def observe(self, step: int, peak_ratio: float) -> None:
        """A step fit; after `shrink_after` such steps that would fit the rung below, step down."""
        if self.index == 0:
            return
        below = RUNGS[self.index - 1]
        self.quiet = self.quiet + 1 if peak_ratio <= SHRINK_MARGIN * below else 0
        if self.quiet >= self.shrink_after:
            old = self.factor
            self.index -= 1
            self.changes += 1
            self.quiet = 0
            log.info(
                "step %d: receive buffers shrink from factor %s to %s (the last %d steps fit it with 5%% to spare)",
                step, _name(old), _name(self.factor), self.shrink_after,
            )  # fmt: skip


def _name(factor: float | None) -> str:
    return "worst case" if factor is None else f"{factor:g}"


class AdaptiveStep:
    """step(state, batch, step_number) -> (state, metrics): the train step on the ladder's current
    rung; a step that overflowed runs again on a bigger rung (synchronously: the overflow count is
    read after every step while the ladder is active)."""

    def __init__(self, cfg: Config, optimizer, mesh, shardings):
        self.cfg, self.optimizer, self.mesh, self.shardings = cfg, optimizer, mesh, shardings
        exchange_devices = sharding.axis_size(mesh, sharding.EXPERT_AXES)
        self.ladder = BufferLadder(cfg.parallel, applies(cfg, exchange_devices))
        self._compiled: dict = {}

    def _fn(self, parallel: ParallelConfig):
        from xmoe_jax.model.functional import model_spec
        from xmoe_jax.train.step import make_train_step

        key = parallel.recv_buffer_factor
        if key not in self._compiled:  # one compiled step per rung visited
            spec = model_spec(self.cfg.model, parallel)
            self._compiled[key] = make_train_step(spec, self.optimizer, self.cfg, self.mesh, self.shardings)
        return self._compiled[key]

    def __call__(self, state, batch: dict, step: int):
        while True:
            state, metrics = self._fn(self.ladder.parallel)(state, batch)
            if not self.ladder.active:
                return state, metrics
            overflow, ratio = int(metrics["num_overflow"]), float(metrics["peak_ratio"])
            if not overflow:
                self.ladder.observe(step, ratio)
                return state, metrics
            if self.ladder.factor is None:
                raise TrainingError(f"step {step}: {overflow} copies overflowed worst-case buffers (a bug)")
            self.ladder.grow(step, overflow, ratio)
