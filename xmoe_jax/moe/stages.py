"""Dispatch paths as generators of named stages, so a benchmark can stop after any one.

A dispatch (pft.py, rbd.py) is written as a generator: at each stage boundary it
yields `(name, arrays)` (the arrays that stage produced) and at the end it returns
its result. The layer exhausts it with `run`; the stage benchmark
(xmoe_jax/perf/stages.py, run by scripts/bench_moe_layer.py) compiles one program per
prefix with `run_until` and times each, so a stage's time is the difference of consecutive prefixes. Tracing a
generator is ordinary Python: the compiled layer is the same as without stages.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

Stages = Generator[tuple[str, tuple], None, Any]


def run(stages: Stages, on_stage: Callable[[str], None] | None = None) -> Any:
    """Run every stage; return the dispatch's result (`on_stage(name)` sees each boundary)."""
    while True:
        try:
            name, _ = next(stages)
        except StopIteration as done:
            return done.value
        if on_stage is not None:
            on_stage(name)


def run_until(stages: Stages, stop: str) -> tuple:
    """The arrays yielded at stage `stop` (the rest of the dispatch is never traced)."""
    seen = []
    for name, values in stages:
        if name == stop:
            return values
        seen.append(name)
    raise KeyError(f"no stage {stop!r}; stages are {seen}")


def prefixed(prefix: str, stages: Stages) -> Stages:
    """The same stages named `prefix/name`, returning the same result (for nested dispatches)."""
    while True:
        try:
            name, values = next(stages)
        except StopIteration as done:
            return done.value
        yield f"{prefix}/{name}", values
