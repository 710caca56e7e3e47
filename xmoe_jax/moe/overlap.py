"""Program order for overlap: the exchange's all-to-alls issued where GEMMs can run under them.

Shapes: T tokens (the shard's), D model.

`parallel.overlap` (config/parallel.py) changes only the order in which a shard_map dispatch (pft, rbd)
is traced, never its values. Both orderings work on the stage generators (stages.py), so
they need no change in the dispatches themselves:

  shared  `with_shared`: the shared experts (an MLP of the block's input only) are traced
          right after the first dispatch exchange and added to the routed output at the
          end. Nothing ties them to the exchange, so a scheduler may run them under the
          dispatch or the combine all-to-all (Megatron's shared-expert overlap).
  chunks  `pipelined`: the `overlap_chunks` chunks are software-pipelined with a lookahead
          of one: chunk i+1 is dispatched (send buffer and exchange) before chunk i's
          expert GEMMs and combine, so one chunk's all-to-all has the other's GEMMs to hide
          under (forward pass; the backward's order is XLA's).

On CPU collectives are synchronous and the compiled order shows only the program order
(tests/test_overlap.py checks it); on GPU the overlap itself needs async collectives and
XLA's latency-hiding scheduler (`parallel.xla_scheduler=latency_hiding`, xla_flags.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from xmoe_jax.moe.stages import Stages

# a stage whose end is a dispatch all-to-all: pft's `exchange`, rbd's cross-node `stage1`
_DISPATCH_EXCHANGES = ("exchange", "stage1")


def is_dispatch_exchange(name: str) -> bool:
    """Whether stage `name` ends with a dispatch all-to-all (any nesting prefix)."""
    return name.rsplit("/", 1)[-1] in _DISPATCH_EXCHANGES


def _dispatched(name: str) -> bool:
    """Whether stage `name` ends the dispatch: its last exchange before the experts (pft's
    `exchange`, rbd's `stage2/exchange`)."""
    return name.rsplit("/", 1)[-1] == "exchange"


def with_shared(stages: Stages, shared_fn: Callable[[], jax.Array]) -> Stages:
    """`stages` (result (y_TD, stats)) with y_TD + shared_fn(); shared_fn is traced after the first
    dispatch exchange (at the end if there is none: one peer), as a stage named `shared`."""
    shared_TD = None
    while True:
        try:
            name, values = next(stages)
        except StopIteration as done:
            y_TD, stats = done.value
            break
        yield name, values
        if shared_TD is None and is_dispatch_exchange(name):
            shared_TD = shared_fn()
            yield "shared", (shared_TD,)
    if shared_TD is None:
        shared_TD = shared_fn()
        yield "shared", (shared_TD,)
    return y_TD + shared_TD, stats


class _Chunk:
    """One chunk's stage generator, advanced in two parts: up to its dispatch, then the rest."""

    def __init__(self, index: int, stages: Stages):
        self.index, self.stages, self.done, self.result = index, stages, False, None

    def _next(self):
        with jax.named_scope(f"chunk{self.index}"):  # HLO metadata names the chunk (the order test)
            return next(self.stages)

    def _steps(self, stop: Callable[[str], bool]) -> Stages:
        while not self.done:
            try:
                name, values = self._next()
            except StopIteration as end:
                self.done, self.result = True, end.value
                return
            yield f"chunk{self.index}/{name}", values
            if stop(name):
                return

    def dispatch(self) -> Stages:
        """Send buffer and dispatch exchange(s) (everything, with no exchange: one peer)."""
        yield from self._steps(_dispatched)

    def finish(self) -> Stages:
        """The rest: experts, return exchange, combine; returns the chunk's result."""
        yield from self._steps(lambda name: False)
        return self.result


def pipelined(chunks: Sequence[Stages]) -> Stages:
    """The chunks' stages interleaved with a lookahead of one; returns their results in order.

    Order: dispatch 0, dispatch 1, rest 0, dispatch 2, rest 1, ..., rest n-1.
    """
    parts = [_Chunk(i, c) for i, c in enumerate(chunks)]
    results = []
    yield from parts[0].dispatch()
    for i, part in enumerate(parts):
        if i + 1 < len(parts):
            yield from parts[i + 1].dispatch()
        results.append((yield from part.finish()))
    return results


def sequential(chunks: Sequence[Stages]) -> Stages:
    """The chunks one after another (no reordering); returns their results in order."""
    results = []
    for i, c in enumerate(chunks):
        results.append((yield from _Chunk(i, c).finish()))
    return results
