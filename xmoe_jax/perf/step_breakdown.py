"""Where a train step's time goes on each GPU: a `jax.profiler` trace cut into categories.

Why: "17% MFU" says nothing about which lever to pull; the trace of a few steps does. A trace
(`train.profile_steps=[a, b]`, docs/profiling.md) holds one plane per GPU whose kernels XLA
annotates with their HLO op, their program and the op's JAX name stack (trace_kernels.py reads
them).

Per GPU:
  1. the step's program is the one with the most kernel time (or `module=`); the window runs from
     its first kernel after the host's first traced dispatch to its last (or over the `Steps` /
     `XLA Modules` events when the trace has them); other programs' kernels in it are their own row;
  2. every kernel gets the first category in `KERNEL_ORDER` whose rule it meets (`_category`);
  3. each category's kernels are merged into a union (concurrent kernels count once), and time is
     handed out in `PRIORITY` order: a category gets the part of its union that no category before
     it already holds. The exchange comes last among the kernels, so it keeps only the time when no
     compute kernel ran (exposed); its time under compute (hidden) is reported beside the table,
     outside the sum. `idle` is the window's time with no kernel at all (host gaps, launch latency,
     waiting on a peer before a collective's kernel starts). The rows sum to the window;
  4. per step = window totals / the number of steps (`--steps`, else `Steps` / `XLA Modules`
     events, else the host's `...::Execute (jit_step)` events in the trace).

The name-stack rules are best effort, and the report says when they could not apply (no kernel
carried a name stack): recompute is JAX's `rematted_computation` scope (what `jax.checkpoint`
recomputes in the backward pass) or XLA's own rematerialization (`.remat` op names); optimizer is
everything at the step's top level (outside jvp/transpose and the micro-batch loop: optax, clipping,
the router-bias update, metrics) or under an optimizer-named scope; the micro-batch loop is work in
the loop but outside the gradient (accumulation adds, slicing). A kernel inside a CUDA graph (XLA's
command buffers, on by default) carries only the name stack its graph's ops share, so these rules
see little of a default trace; docs/profiling.md says how to take one without graphs.
"""

from __future__ import annotations

import collections
import functools
import os
import re

from xmoe_jax.perf.kernel_overlap import GEMM_PATTERN, NCCL_PATTERN, Interval, intersection, length, union
from xmoe_jax.perf.trace_kernels import (
    Kernel,
    PlaneTrace,
    TraceError,
    host_dispatches,
    read_trace,
)

LABELS = {
    "optimizer": "optimizer & update",
    "recompute": "recompute",
    "attention": "attention",
    "expert_gemm": "expert GEMMs",
    "other_gemm": "other GEMMs",
    "loop": "micro-batch loop",
    "other_compute": "other compute",
    "other_programs": "other programs",
    "exchange_exposed": "exchange, exposed",
    "idle": "idle",
}
# time goes to the first category of PRIORITY that holds it; idle is the rest of the window
PRIORITY = tuple(k for k in LABELS if k != "idle")
ROWS = (*PRIORITY, "idle")
# a kernel goes to the first category whose rule it meets
KERNEL_ORDER = ("other_programs", "exchange", "optimizer", "recompute", "attention", "expert_gemm")
KERNEL_ORDER += ("other_gemm", "loop", "other_compute")
NAME_STACK_CATEGORIES = ("optimizer", "recompute", "loop")

ATTENTION = re.compile(r"flash|fmha|attention|sdpa|mha_", re.IGNORECASE)
# jax.nn.dot_product_attention's scope, and the einsums of its XLA implementation
ATTENTION_SCOPE = re.compile(r"dot_product_attention|BTNH,BSNH->BNTS|BNTS,BSNH->BTNH")
EXPERT_GEMM = re.compile(r"gmm|ragged[-_]?dot|grouped_?gemm", re.IGNORECASE)
COLLECTIVE_OP = re.compile(
    r"all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute|collective-broadcast", re.I
)
# our Pallas permutation kernels (kernels/permute): gathers and a per-row dot, not GEMMs
OUR_PERMUTE = re.compile(r"xmoe_(scatter_rows|combine|gather_dot)")
OPTIMIZER_SCOPE = re.compile(r"optax|optimi[sz]er|adamw?\b|scale_by_adam|apply_updates", re.IGNORECASE)
XLA_REMAT = re.compile(r"\.remat")
COLLECTIVE_KINDS = (
    ("push", re.compile(r"^xmoe_push")),  # our exchange kernel (kernels/push), not a collective of XLA's
    ("all-to-all", re.compile(r"all-to-all|sendrecv|alltoall|ragged|collective-permute", re.I)),
    ("all-reduce", re.compile(r"all-?reduce", re.I)),
    ("all-gather", re.compile(r"all-?gather", re.I)),
    ("reduce-scatter", re.compile(r"reduce-?scatter", re.I)),
)


# ----------------------------------------------------------------------------- categories


@functools.lru_cache(maxsize=65536)
def region(stack: str) -> str:
    """`grad` (under jvp/transpose: forward and backward), `loop` (in a loop outside the
    gradient: the micro-batch loop) or `top` (the step's top level)."""
    parts = stack.split("/")
    if any(p.startswith(("jvp(", "transpose(", "vjp(")) or p in ("jvp", "transpose") for p in parts):
        return "grad"
    return "loop" if "while" in parts or "scan" in parts else "top"


def in_scope(stack: str, scope: str) -> bool:
    """Whether `stack` passes through `jax.named_scope(scope)`; a transform wraps the scope's
    name (`jvp(experts)`, `transpose(jvp(experts))`)."""
    return re.search(rf"(?:^|[/(]){re.escape(scope)}(?:[)/]|$)", stack) is not None


@functools.lru_cache(maxsize=65536)
def _by_name(name: str, hlo_op: str) -> tuple[bool, bool, bool, bool]:
    """(expert GEMM, exchange, attention, GEMM) by the kernel's and its op's names."""
    expert = bool(EXPERT_GEMM.search(name) or EXPERT_GEMM.search(hlo_op))
    exchange = not expert and bool(NCCL_PATTERN.search(name) or COLLECTIVE_OP.search(hlo_op))
    attention = bool(ATTENTION.search(name) or ATTENTION.search(hlo_op))
    gemm = bool(GEMM_PATTERN.search(name)) and not OUR_PERMUTE.search(name)
    return expert, exchange, attention, gemm


def collective_kind(kernel: Kernel) -> str:
    for kind, pattern in COLLECTIVE_KINDS:
        if pattern.search(kernel.hlo_op) or pattern.search(kernel.name):
            return kind
    return "other"


def _category(k: Kernel, step_module: str | None) -> str:
    """The first category of KERNEL_ORDER whose rule `k` meets."""
    if step_module and k.module and k.module != step_module:
        return "other_programs"
    expert, exchange, attention, gemm = _by_name(k.name, k.hlo_op)
    if exchange:
        return "exchange"
    # a kernel of a CUDA graph (XLA command buffer) carries the graph's common name stack: a
    # scope in it holds for every kernel of the graph, where it sits (top level, loop) does not
    in_graph = k.hlo_op.startswith("command_buffer")
    where = region(k.stack) if k.stack is not None and not in_graph else None
    if k.stack is not None and (where == "top" or OPTIMIZER_SCOPE.search(k.stack)):
        return "optimizer"
    if (k.stack is not None and "rematted" in k.stack) or XLA_REMAT.search(k.hlo_op):
        return "recompute"
    if attention or (k.stack is not None and ATTENTION_SCOPE.search(k.stack)):
        return "attention"
    if expert or (gemm and k.stack is not None and in_scope(k.stack, "experts")):
        return "expert_gemm"
    if gemm:
        return "other_gemm"
    return "loop" if where == "loop" else "other_compute"


def step_module(planes: list[PlaneTrace], pattern: str | None) -> str | None:
    """The program whose kernels took the most time (among those matching `pattern`)."""
    busy: collections.Counter = collections.Counter()
    for p in planes:
        for k in p.kernels:
            if k.module:
                busy[k.module] += k.end - k.start
        for start, end, name in p.modules:
            busy[name] += 0.0 if p.kernels else end - start
    names = [m for m, _ in busy.most_common() if pattern is None or re.search(pattern, m)]
    if pattern is not None and not names:
        raise TraceError(f"no program in the trace matches --module {pattern!r}; programs: {sorted(busy)}")
    return names[0] if names else None


# ----------------------------------------------------------------------------- one GPU


def _clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def window_of(
    plane: PlaneTrace, module: str | None, not_before: float = float("-inf")
) -> tuple[Interval, int]:
    """(start, end) of the traced steps on this GPU, and the number of step events found (0:
    none, the window is the step program's first to last kernel that starts at `not_before` or
    later: the first traced dispatch, so that the tail of an earlier step stays out)."""
    if plane.steps:
        return (plane.steps[0][0], max(e for _, e in plane.steps)), len(plane.steps)
    runs = [(s, e) for s, e, name in plane.modules if name == module]
    if runs:
        return (runs[0][0], max(e for _, e in runs)), len(runs)
    mine = [k for k in plane.kernels if (module is None or k.module == module) and k.start >= not_before]
    mine = mine or plane.kernels
    return (min(k.start for k in mine), max(k.end for k in mine)), 0


def gpu_breakdown(
    plane: PlaneTrace, module: str | None, num_steps: int, not_before: float = float("-inf")
) -> dict:
    """ms per step by category for one GPU (module docstring, steps 2-4)."""
    window, _ = window_of(plane, module, not_before)
    cats: dict[str, list[Interval]] = {c: [] for c in KERNEL_ORDER}
    by_kind: dict[str, list[Interval]] = collections.defaultdict(list)
    top: dict[str, collections.Counter] = {c: collections.Counter() for c in KERNEL_ORDER}
    counts: dict[str, collections.Counter] = {c: collections.Counter() for c in KERNEL_ORDER}
    copies, copy_counts = collections.Counter(), collections.Counter()  # by source_of
    other, other_counts = collections.Counter(), collections.Counter()  # other compute, by source_of
    stacked = busy = in_graph = 0.0
    memo: dict[tuple, str] = {}
    for k in plane.kernels:
        if k.end <= window[0] or k.start >= window[1]:
            continue
        key = (k.name, k.hlo_op, k.module, k.stack)
        cat = memo.get(key) or memo.setdefault(key, _category(k, module))
        cats[cat].append((k.start, k.end))
        top[cat][k.name] += k.end - k.start
        counts[cat][k.name] += 1
        if cat == "exchange":
            by_kind[collective_kind(k)].append((k.start, k.end))
        if k.name.startswith("Memcpy"):
            source = source_of(k)
            copies[source] += k.end - k.start
            copy_counts[source] += 1
        elif cat == "other_compute":
            source = source_of(k, depth=5)
            other[source] += k.end - k.start
            other_counts[source] += 1
        busy += k.end - k.start
        stacked += (k.end - k.start) if k.stack is not None else 0.0
        in_graph += (k.end - k.start) if k.hlo_op.startswith("command_buffer") else 0.0
    unions = {c: union(_clip(v, window)) for c, v in cats.items()}
    unions["exchange_exposed"] = unions.pop("exchange")
    out_ns, covered = {}, []
    for cat in PRIORITY:
        own = unions[cat]
        out_ns[cat] = length(own) - length(intersection(own, covered))
        covered = union(covered + own)
    wall = window[1] - window[0]
    out_ns["idle"] = wall - length(covered)
    compute = union([iv for c in PRIORITY if c != "exchange_exposed" for iv in unions[c]])
    exchange = unions["exchange_exposed"]
    hidden = length(intersection(exchange, compute))
    per_step = 1e-6 / num_steps  # ns over the window -> ms per step
    kinds = {}
    for kind, ivs in sorted(by_kind.items()):
        u = union(_clip(ivs, window))
        kinds[kind] = {
            "total_ms": length(u) * per_step,
            "exposed_ms": (length(u) - length(intersection(u, compute))) * per_step,
        }
    return {
        "step_ms": wall * per_step,
        "ms": {c: out_ns[c] * per_step for c in ROWS},
        "exchange_hidden_ms": hidden * per_step,
        "exchange_total_ms": length(exchange) * per_step,
        "exchange_by_collective": kinds,
        "kernels": sum(len(v) for v in cats.values()),
        "name_stack_coverage": stacked / busy if busy else 0.0,
        "cuda_graph_share": in_graph / busy if busy else 0.0,
        "top": {
            c: [(name, ns * per_step, counts[c][name] / num_steps) for name, ns in top[c].most_common(5)]
            for c in KERNEL_ORDER
            if top[c]
        },
        "copies": [(src, ns * per_step, copy_counts[src] / num_steps) for src, ns in copies.most_common(6)],
        "other_compute": [
            (src, ns * per_step, other_counts[src] / num_steps)
            for src, ns in other.most_common(OTHER_SOURCES)
        ],
    }


OTHER_SOURCES = 10  # the other-compute kernels listed by source


def source_of(k: Kernel, depth: int = 3) -> str:
    """Where a kernel comes from: its name, its HLO op without the number and the last `depth` scopes
    of its JAX name stack (`eval_jaxpr` left out), e.g. `MemcpyD2D: loop_dynamic_slice_fusion @
    jvp()/while/body`."""
    op = k.hlo_op.rstrip("0123456789").rstrip(".") or "?"
    scopes = [s for s in (k.stack or "").split("/") if s and s != "eval_jaxpr"]
    return f"{k.name}: {op} @ {'/'.join(scopes[-depth:]) or '?'}"


# ----------------------------------------------------------------------------- a trace folder


def _label(path: str, folder: str, plane_name: str, index: int, several: bool) -> str:
    gpu = "GPU" + plane_name.rsplit(":", 1)[-1]
    if not several:
        return gpu
    first = os.path.relpath(path, folder).split(os.sep)[0]
    return f"{first if first.startswith('process_') else f'file{index}'}/{gpu}"


def named_from_hlo(plane: PlaneTrace, names: dict[str, str]) -> tuple[PlaneTrace, int]:
    """The plane with every kernel that the trace names by its program only (`jit(step)`) or not at all
    given the name stack of its HLO instruction (`perf.hlo.op_names` of the step's optimized HLO), and
    how many kernels that renamed. Such a kernel is a multi-output fusion (XLA's gather of several
    layers' rows) that `_category`'s top-level rule would count as the optimizer."""
    renamed, kernels = 0, []
    for k in plane.kernels:
        found = names.get(k.hlo_op) if (k.stack is None or "/" not in k.stack) else None
        if found and "/" in found:
            k, renamed = k._replace(stack=found), renamed + 1
        kernels.append(k)
    return plane._replace(kernels=kernels), renamed


def breakdown(
    folder: str, steps: int | None = None, module: str | None = None, hlo_names: dict[str, str] | None = None
) -> dict:
    """The report of every trace file under `folder`: per GPU and the mean over GPUs. `hlo_names`
    (`perf.hlo.op_names` of the step's optimized HLO) names the kernels the trace names by program only."""
    if steps is not None and steps < 1:
        raise TraceError(f"--steps {steps}: the number of traced steps must be at least 1")
    loaded = read_trace(folder)
    mod = step_module([pt for _, _, planes in loaded for _, pt in planes], module)
    notes, gpus = [], {}
    for index, (path, profile, planes) in enumerate(loaded):
        host = host_dispatches(profile, mod or "")
        for plane_name, pt in planes:
            if hlo_names:
                pt, renamed = named_from_hlo(pt, hlo_names)
                notes.append(
                    f"{plane_name}: {renamed} kernels named from the HLO (the trace named their program only)"
                )
            if not pt.kernels:
                notes.append(f"{path}:{plane_name} holds no kernels; left out")
                continue
            _, found = window_of(pt, mod)
            n, source = (found, "Steps line" if pt.steps else "XLA Modules line") if found else host[:2]
            if steps is not None:
                if n and n != steps:
                    notes.append(f"{plane_name}: the trace's {source} say {n} steps, --steps says {steps}")
                n, source = steps, "--steps"
            if not n:
                raise TraceError(
                    f"cannot tell how many steps {path} covers: pass --steps N "
                    "(train.profile_steps=[a, b] traces b - a + 1 steps)"
                )
            row = gpu_breakdown(pt, mod, n, host.first_ns)
            row.update(device=f"{path}:{plane_name}", steps=n, steps_from=source)
            gpus[_label(path, folder, plane_name, index, len(loaded) > 1)] = row
    return _summarise(gpus, mod, notes)


def _summarise(gpus: dict, module: str | None, notes: list[str]) -> dict:
    """The mean over GPUs, the largest kernels and what could not be identified."""
    rows = list(gpus.values())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    kinds = sorted({k for r in rows for k in r["exchange_by_collective"]})
    summary = {
        "step_ms": mean([r["step_ms"] for r in rows]),
        "ms": {c: mean([r["ms"][c] for r in rows]) for c in ROWS},
        "exchange_hidden_ms": mean([r["exchange_hidden_ms"] for r in rows]),
        "exchange_total_ms": mean([r["exchange_total_ms"] for r in rows]),
        "exchange_by_collective": {
            k: {
                f: mean([r["exchange_by_collective"].get(k, {}).get(f, 0.0) for r in rows])
                for f in ("total_ms", "exposed_ms")
            }
            for k in kinds
        },
        "name_stack_coverage": mean([r["name_stack_coverage"] for r in rows]),
        "cuda_graph_share": mean([r["cuda_graph_share"] for r in rows]),
    }
    top = {}
    for cat in KERNEL_ORDER:
        ms, count = collections.Counter(), collections.Counter()
        for r in rows:
            for name, m, c in r["top"].get(cat, []):
                ms[name] += m / len(rows)
                count[name] += c / len(rows)
        if ms:
            top[cat] = [[name, m, count[name]] for name, m in ms.most_common(5)]
    by_source = {key: _mean_sources(rows, key) for key in ("copies", "other_compute")}
    unidentified = []
    if summary["name_stack_coverage"] == 0:
        unidentified = list(NAME_STACK_CATEGORIES)
        notes.append(
            "no kernel carries a JAX name stack (stats name/op_name/tf_op/long_name): optimizer, "
            "recompute and micro-batch loop could not be identified; their kernels are counted by name"
        )
    elif summary["name_stack_coverage"] < 0.5:
        notes.append(
            f"only {100 * summary['name_stack_coverage']:.0f}% of kernel time carries a JAX name stack: "
            "optimizer, recompute and micro-batch loop are lower bounds"
        )
    if summary["cuda_graph_share"] > 0.05:
        notes.append(
            f"{100 * summary['cuda_graph_share']:.0f}% of kernel time ran in CUDA graphs (XLA command "
            "buffers), whose kernels carry only the graph's common name stack: recompute, optimizer, "
            "micro-batch loop and the experts scope are undercounted; for attribution retake the trace "
            "with XLA_FLAGS=--xla_gpu_enable_command_buffer= (docs/profiling.md)"
        )
    if module is None:
        notes.append(
            "the kernels name no program (hlo_module): every kernel in the window counts as the step's"
        )
    if summary["ms"]["attention"] == 0:
        notes.append(
            "no attention kernel by name (flash/fmha/sdpa/mha_): XLA's own attention runs as GEMMs and "
            "fusions, counted under other GEMMs / other compute"
        )
    if summary["ms"]["expert_gemm"] == 0:
        notes.append("no expert GEMM by name (gmm, ragged_dot) or under the `experts` scope")
    return {
        "module": module,
        "priority": list(ROWS),
        "labels": LABELS,
        "unidentified": unidentified,
        "gpus": gpus,
        "mean": summary,
        "top_kernels": top,
        "copies": by_source["copies"][:6],
        "other_compute": by_source["other_compute"][:OTHER_SOURCES],
        "notes": notes,
    }


def _mean_sources(rows: list[dict], key: str) -> list[list]:
    """[source, ms, launches] per step, the mean over GPUs, largest first."""
    ms, n = collections.Counter(), collections.Counter()
    for r in rows:
        for src, m, c in r.get(key, []):
            ms[src] += m / len(rows)
            n[src] += c / len(rows)
    return [[src, m, n[src]] for src, m in ms.most_common()]
