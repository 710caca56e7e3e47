"""Collective traffic read from compiled HLO text (for benchmarks and sharding comparisons).

Counts every collective op in the optimized module and the bytes of its result
shape(s): for all-to-all that is the buffer each device exchanges (including the
slice it keeps), for all-gather the gathered result, for reduce-scatter the
scattered piece, for all-reduce the reduced buffer. `scheduled_ops` lists the collectives
and dots of a compiled (scheduled) module in the order they run. `op_names` maps each
instruction to the JAX name stack its metadata carries (for a trace that lacks it).
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

COLLECTIVES = (
    "ragged-all-to-all",
    "all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(re.escape(c) for c in COLLECTIVES) + r")(-start)?\(")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def group_size(line: str) -> int | None:
    """Devices per replica group of an HLO collective line (None if it names none)."""
    if m := _GROUPS_LIST.search(line):
        return len([d for d in m.group(1).split(",") if d])
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(1))
    if m := _GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2))]))
    return None


def collective_stats(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count": n, "bytes": result bytes summed}} over the module (async pairs counted once).

    Collectives over one-device groups (a psum over a size-1 mesh axis) move nothing and are
    left out.
    """
    stats: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m or "-done(" in line or group_size(line) == 1:
            continue
        op = m.group(2)
        stats[op]["count"] += 1
        stats[op]["bytes"] += _shape_bytes(m.group(1))
    return dict(stats)


_ENTRY_OP = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=.*?\s([a-z][a-z0-9-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def scheduled_ops(hlo_text: str) -> list[tuple[str, str]]:
    """(kind, op_name) of the entry computation's collectives and dots, in the compiled order.

    kind is the collective (`all-to-all`, ...) or `dot` for an instruction whose op_name ends in a
    dot (a fusion or call around a dot carries its root's name; ragged dots included). A compiled
    module is scheduled (`is_scheduled=true`), so this is the order the device runs them in, one
    stream at a time; async pairs count at their start.
    """
    out, entry = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            entry = True
            continue
        if not entry:
            continue
        if line.startswith("}"):
            break
        m = _ENTRY_OP.match(line)
        if not m or "-done(" in line:
            continue
        name = _OP_NAME.search(line)
        op_name = name.group(1) if name else ""
        op = m.group(2).removesuffix("-start")
        if op in COLLECTIVES:
            out.append((op, op_name))
        elif op == "dot" or op_name.endswith(("dot_general", "ragged_dot")):
            out.append(("dot", op_name))
    return out


_INSTRUCTION_OP_NAME = re.compile(
    r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = [^\n]*?\bmetadata=\{[^}\n]*?\bop_name="([^"]*)"', re.M
)


def op_names(hlo_text: str) -> dict[str, str]:
    """{instruction: the JAX name stack in its metadata} over a module's text (`op_name="jit(step)/..."`).
    A GPU trace names some kernels by their program only (a multi-output fusion that merges ops of several
    places); the optimized HLO still holds the op_name XLA gave the fusion (perf/step_breakdown.py)."""
    return {m.group(1): m.group(2) for m in _INSTRUCTION_OP_NAME.finditer(hlo_text)}
