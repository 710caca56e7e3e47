"""The receive-buffer ladder: which size pft/rbd's static exchange buffers compile with.

pft and rbd move routed rows through static buffers (moe/layouts.py). Sized for the worst
case they cost memory (and, with the bucketed transport, wire time) in every step; sized
near the average they overflow when routing is uneven. The trainer keeps a ladder of sizes,
in multiples of the average load,

    1.05  1.1  1.15  1.2  1.3  1.4  1.5  1.75  2  2.5  3  worst case

and compiles one train step per rung it visits (train/buffers.py). Each step reports how
full its fullest buffer had to be (`peak_ratio`: the factor that would just fit) and how
many copies did not fit. The rules:
  1. grow: a step with copies that did not fit moves to the smallest rung that holds its
     peak with `GROW_HEADROOM` to spare (so the next step's peak, a little higher, still
     fits), at least one rung up;
  2. shrink: after `buffer_shrink_after` steps in a row (`SHRINK_AFTER` by default) whose peaks all fit a
     smaller rung with `SHRINK_MARGIN` to spare, move straight to the smallest rung that
     holds the largest peak of those steps with that margin: one recompilation, not one per
     rung, and a transient spike costs tens of steps at a bigger size, not the rest of the run.
  3. every change is logged (step, old and new factor, why) and counted.
A transport whose record says its buffers do not shrink (`push`: one receive buffer per run,
moe/transports.py) only grows, rarely: in steady state it never recompiles. A pace the user names
(`parallel.buffer_shrink_after`) shrinks it too.

Bookkeeping on the host (no arrays): the trainer, the placement resolver and the benchmarks use it.
"""

from __future__ import annotations

import dataclasses
import logging

from xmoe_jax.config import Config, ParallelConfig
from xmoe_jax.moe import transports
from xmoe_jax.moe.dispatchers import exchanges_tokens

log = logging.getLogger("xmoe_jax")

RUNGS: tuple[float | None, ...] = (1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0, None)
DEFAULT_START = 1.2
SHRINK_AFTER = 20  # quiet steps before a shrink, where parallel.buffer_shrink_after is null
GROW_HEADROOM = 1.05  # a grown buffer holds the overflowing peak x this
SHRINK_MARGIN = 0.95  # a rung is shrunk to when the quiet steps' peaks fit it x this


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
    """Whether the ladder sizes this run's buffers: dropless pft/rbd over more than one device."""
    moe = cfg.model.moe
    return (
        moe is not None  # without experts, dispatch is not read (it may be `auto`)
        and cfg.parallel.adaptive_buffers
        and exchanges_tokens(cfg.parallel.dispatch)
        and moe.capacity_factor is None
        and num_exchange_devices > 1
    )


def _name(factor: float | None) -> str:
    return "worst case" if factor is None else f"{factor:g}"


class BufferLadder:
    """Which rung the next step runs on; `grow` after an overflow, `observe` after a step that fit."""

    def __init__(self, parallel: ParallelConfig, active: bool, peers: int | None = None):
        self.active, self.peers = active, peers  # peers: the devices of the exchange (what a resume checks)
        start = parallel.recv_buffer_factor if parallel.recv_buffer_factor is not None else DEFAULT_START
        self.index = _rung_index(start) if active else -1
        self.base = parallel
        # the user's pace, else the transport's: one that keeps one buffer per run only grows (`auto` as
        # the table settles it)
        shrinks = transports.choose(parallel.transport).buffers_shrink
        pace = parallel.buffer_shrink_after
        self.shrink_after = pace if pace is not None else (SHRINK_AFTER if shrinks else None)
        self.quiet = 0  # steps in a row whose peak fits a smaller rung
        self.quiet_peak = 0.0  # the largest peak of those steps
        self.changes = 0

    @property
    def factor(self) -> float | None:
        return RUNGS[self.index] if self.active else self.base.recv_buffer_factor

    @property
    def parallel(self) -> ParallelConfig:
        """The placement the current rung compiles with."""
        return dataclasses.replace(self.base, recv_buffer_factor=self.factor) if self.active else self.base

    def _setting(self) -> dict:
        """What a rung is a rung of: a resume on other settings starts afresh."""
        base = self.base
        return {"transport": base.transport, "dispatch": base.dispatch, "peers": self.peers,
                "start": base.recv_buffer_factor}  # fmt: skip

    def state(self) -> dict | None:
        """What a checkpoint keeps of the ladder (train/checkpoint.py): the rung in effect and the settings it
        is a rung of; None where the ladder does not apply."""
        return {"recv_buffer_factor": self.factor, "setting": self._setting()} if self.active else None

    def resume(self, saved: dict | None, step: int) -> None:
        """A resumed run starts on the rung its checkpoint's run had reached (`saved`: `state()` at that
        step): it does not grow (or shrink) and recompile its way there again (three grows of the 28-layer
        Small on 4x H200, benchmarks/exchange.md). Only on the same settings: another transport, dispatch,
        number of exchange devices or a start the user changed begins on its own start, as does a checkpoint
        without it (an older xmoe_jax). Not a change: nothing was compiled yet."""
        if not self.active or not saved or "recv_buffer_factor" not in saved:
            return
        if saved.get("setting") != self._setting():
            log.info(
                "step %d: the checkpoint's receive buffers were sized for other settings (%s, not %s): "
                "starting at factor %s", step, saved.get("setting"), self._setting(), _name(self.factor),
            )  # fmt: skip
            return
        index = _rung_index(saved["recv_buffer_factor"])
        if index != self.index:
            start, self.index = self.factor, index
            log.info(
                "resumed at step %d on the receive buffers' factor the run had reached, %s (not %s): no "
                "recompiling to get back there",
                step, _name(self.factor), _name(start),
            )  # fmt: skip

    def _move(self, index: int) -> float | None:
        old = self.factor
        self.index = index
        self.changes += 1
        self.quiet, self.quiet_peak = 0, 0.0
        return old

    def grow(self, step: int, overflow: int, peak_ratio: float) -> None:
        """The step overflowed: move to the smallest rung that holds `peak_ratio` with headroom."""
        old = self._move(max(self.index + 1, _rung_index(peak_ratio * GROW_HEADROOM)))
        log.info(
            "step %d: %d routed copies did not fit the receive buffers (factor %s; the fullest needed %.2fx "
            "the average): not applied, running it again with factor %s",
            step, overflow, _name(old), peak_ratio, _name(self.factor),
        )  # fmt: skip

    def observe(self, step: int, peak_ratio: float) -> None:
        """A step fit; after `shrink_after` steps in a row that fit a smaller rung, move down to the
        smallest rung that holds all their peaks with `SHRINK_MARGIN` to spare."""
        if self.index == 0 or self.shrink_after is None:
            return
        target = _rung_index(peak_ratio / SHRINK_MARGIN)
        if target >= self.index:
            self.quiet, self.quiet_peak = 0, 0.0
            return
        self.quiet += 1
        self.quiet_peak = max(self.quiet_peak, peak_ratio)
        if self.quiet >= self.shrink_after:
            peak = self.quiet_peak
            old = self._move(_rung_index(peak / SHRINK_MARGIN))
            log.info(
                "step %d: receive buffers shrink from factor %s to %s (the last %d steps peaked at %.2fx "
                "the average, within %d%% of it)",
                step, _name(old), _name(self.factor), self.shrink_after, peak, round(100 * (1 - SHRINK_MARGIN)),
            )  # fmt: skip
