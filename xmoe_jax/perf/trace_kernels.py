"""The kernels of a `jax.profiler` trace, each with its HLO op, its program and its JAX name stack.

What a GPU trace holds (written by `train.profile_steps` or `jax.profiler.trace`; seen on an H100
with jax 0.11.2): one plane per GPU (`/device:GPU:<i>`) whose `Stream #...` lines are the kernels
and copies as the GPU ran them (kernel_overlap.py reads the same lines). XLA annotates each with
stats: `hlo_op` (the HLO instruction, or `command_buffer_<n>` for a kernel of a CUDA graph),
`hlo_module` (the program, `jit_step`), and `name`, the op's JAX name stack (`jit(step)/while/...
/transpose(jvp())/.../dot_general`; with a `prefix` stat when the annotation shortened it). A trace
that went through xprof also has derived `XLA Ops` / `XLA Modules` / `Steps` lines, read when
present. The host plane records each run of a program as `...::Execute (jit_step)`.
"""

from __future__ import annotations

import bisect
import re
from typing import NamedTuple

from xmoe_jax.errors import EXIT_BAD_INPUT, XmoeError
from xmoe_jax.perf.kernel_overlap import Interval, trace_files


class TraceError(XmoeError):
    """The trace cannot be read into a breakdown (no trace, no GPU plane, no step count)."""

    exit_code = EXIT_BAD_INPUT


# ops XLA adds without JAX metadata: without a `name` they are not top-level JAX code
NO_METADATA_OP = re.compile(r"^(wrapped_)?(copy|bitcast|tuple|get-tuple-element|parameter|while|conditional)")


class Kernel(NamedTuple):
    start: float
    end: float
    name: str
    hlo_op: str
    module: str  # "" when the trace does not say
    stack: str | None  # the JAX name stack, None when the trace does not say


def _stats(event) -> dict:
    out = {}
    for key, value in event.stats:
        if key is not None and key not in out:
            out[key] = value
    return out


def name_stack(stats: dict) -> str | None:
    """The op's JAX name stack (`jit(step)/.../dot_general`) from a kernel's or XLA op's stats."""
    if stats.get("op_name"):
        return str(stats["op_name"])
    prefix, name = str(stats.get("prefix") or ""), str(stats.get("name") or "")
    if name:
        return f"{prefix}/{name}" if prefix and not name.startswith(prefix) else name
    tf_op = str(stats.get("tf_op") or "")
    if "/" in tf_op:
        return tf_op
    found = re.search(r'op_name="([^"]*)"', str(stats.get("long_name") or ""))
    if found:
        return found.group(1)
    # an annotation drops empty values: an op named exactly the program's prefix has no `name`
    hlo_op = str(stats.get("hlo_op") or "")
    if prefix and hlo_op and not NO_METADATA_OP.match(hlo_op):
        return prefix
    return None


def _module_name(event_name: str) -> str:
    return re.sub(r"\(\d+\)$", "", event_name)  # xprof names module events `jit_step(12)`


class PlaneTrace(NamedTuple):
    kernels: list[Kernel]
    steps: list[Interval]  # `Steps` line events (xprof), else empty
    modules: list[tuple[float, float, str]]  # `XLA Modules` line events


def read_plane(plane) -> PlaneTrace:
    """Kernels of one GPU plane with their op, program and name stack."""
    raw, ops, modules, steps = [], [], [], []
    for line in plane.lines:
        if line.name == "XLA Ops":
            ops = sorted((e.start_ns, e.end_ns, e.name, _stats(e)) for e in line.events)
        elif line.name == "XLA Modules":
            modules = sorted((e.start_ns, e.end_ns, _module_name(e.name)) for e in line.events)
        elif line.name == "Steps":
            steps = sorted((e.start_ns, e.end_ns) for e in line.events)
        elif line.name.startswith("Stream"):  # as kernel_overlap: the other lines are not kernels
            raw.extend((e.start_ns, e.end_ns, e.name, _stats(e)) for e in line.events)
    op_starts, module_starts = [o[0] for o in ops], [m[0] for m in modules]
    kernels = []
    for start, end, name, stats in raw:
        hlo_op, module, stack = (
            str(stats.get("hlo_op") or ""),
            str(stats.get("hlo_module") or ""),
            name_stack(stats),
        )
        i = bisect.bisect_right(op_starts, start) - 1
        if i >= 0 and start < ops[i][1]:  # the derived XLA op that covers this kernel
            hlo_op = hlo_op or ops[i][2]
            stack = stack or name_stack(ops[i][3])
        j = bisect.bisect_right(module_starts, start) - 1
        if not module and j >= 0 and start < modules[j][1]:
            module = modules[j][2]
        kernels.append(Kernel(start, end, name, hlo_op, module, stack))
    return PlaneTrace(kernels, steps, modules)


def _outermost(events) -> int:
    """How many of `events` (one host thread's) are not nested in another of them: jaxlib
    records `PjitFunction(step)` twice, one inside the other, per call."""
    count, end = 0, float("-inf")
    for start, stop in sorted(events):
        if start >= end:
            count += 1
        end = max(end, stop)
    return count


class HostSteps(NamedTuple):
    count: int  # 0: the host events say nothing
    source: str
    first_ns: float  # when the first of them began: no kernel of a traced step starts before it


def host_dispatches(profile, module: str) -> HostSteps:
    """How many times the host ran `module` in the trace, and the host event that says so:
    PjRt's `...::Execute (jit_step)` (one per step on the calling thread, seen with jax 0.11.2 on
    one GPU), else the Python call `PjitFunction(step)`."""
    lines = [line for plane in profile.planes if plane.name.startswith("/host") for line in plane.lines]
    targets = (
        (f"::Execute ({module})", str.endswith),
        (f"PjitFunction({module.removeprefix('jit_')})", str.__eq__),
    )
    for target, match in targets:
        per_line = [[(e.start_ns, e.end_ns) for e in line.events if match(e.name, target)] for line in lines]
        # the most on one thread: a runtime that ran each GPU's share on its own thread would
        # record the step once per GPU, on as many threads
        found = max(_outermost(events) for events in per_line) if per_line else 0
        if found:
            first = min(start for events in per_line for start, _ in events)
            return HostSteps(found, f"host events {target.lstrip(':')}", first)
    return HostSteps(0, "host events", float("-inf"))


def read_trace(folder: str) -> list[tuple[str, object, list[tuple[str, PlaneTrace]]]]:
    """(file, ProfileData, [(GPU plane name, its kernels)]) for each trace file under `folder`."""
    from jax.profiler import ProfileData

    files = trace_files(folder)
    if not files:
        raise TraceError(
            f"no *.xplane.pb under {folder}: take a trace with train.profile_steps=[a, b] (docs/profiling.md)"
        )
    loaded = []
    for path in files:
        try:
            profile = ProfileData.from_file(path)
        except Exception as err:  # a truncated or foreign file: say which one
            raise TraceError(f"cannot read {path} ({err}); is the trace complete?") from err
        planes = [(p.name, read_plane(p)) for p in profile.planes if p.name.startswith("/device:GPU")]
        loaded.append((path, profile, planes))
    if not any(planes for _, _, planes in loaded):
        raise TraceError(
            f"no GPU plane (/device:GPU:<i>) in the {len(files)} trace file(s) under {folder}: a CPU "
            "run has no GPU kernels to break down; take the trace on GPUs"
        )
    if not any(pt.kernels for _, _, planes in loaded for _, pt in planes):
        raise TraceError(f"the GPU planes under {folder} hold no kernels: did the traced steps run?")
    return loaded
