"""Did the exchange run under compute? Kernel intervals from a `jax.profiler` trace, per GPU.

A trace (`*.xplane.pb`, written by `train.profile_steps` or `jax.profiler.trace`) holds one plane
per GPU (`/device:GPU:<i>`) whose `Stream #...` lines are the kernels as the GPU ran them. Per GPU:
  1. kernels are sorted into the exchange (`nccl` in the name, XLA's own ragged all-to-all
     kernel that the `exact` transport runs: `ragged` in the name, or our push kernel `xmoe_push`, which
     runs on the compute stream), GEMM (cuBLAS/cuBLASLt, CUTLASS, Triton
     GEMM fusions, our Pallas grouped GEMMs `xmoe_gmm`/`xmoe_tgmm`: `GEMM_PATTERN`) and other compute;
  2. each kind's intervals are merged into a union (overlapping kernels of one kind count once);
  3. the report is the time NCCL kernels ran, and how much of it a GEMM (or any compute kernel) ran
     at the same time: the length of the intersection of the unions.
`overlap_ms > 0` means the exchange really ran concurrently with GEMMs; 0 means every NCCL kernel
ran alone (XLA's default scheduler: an all-to-all between two waits).

    python scripts/kernel_overlap.py "$OUT/profile_on"    # prints one line per GPU, JSON with --out
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable

# the exchange's kernels: NCCL's, XLA's ragged all-to-all, our push (kernels/push). The GEMM with the push
# inside it (`xmoe_gmm_ws_push`) is a GEMM: its exchange cannot be told apart in a trace (benchmarks/exchange.md)
NCCL_PATTERN = re.compile(r"nccl|ragged|^xmoe_push", re.IGNORECASE)
GEMM_PATTERN = re.compile(r"gemm|gmm|nvjet|cutlass|xmma|cublas|matmul|_dot", re.IGNORECASE)

Interval = tuple[float, float]  # (start, end) in ns


def kernel_kind(name: str) -> str:
    """`nccl`, `gemm` or `compute` for a GPU kernel name."""
    if NCCL_PATTERN.search(name):
        return "nccl"
    return "gemm" if GEMM_PATTERN.search(name) else "compute"


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def device_kernels(profile) -> dict[str, dict[str, list[Interval]]]:
    """{GPU plane name: {kind: intervals}} from a `jax.profiler.ProfileData`."""
    out: dict[str, dict[str, list[Interval]]] = {}
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        kinds: dict[str, list[Interval]] = {"nccl": [], "gemm": [], "compute": []}
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # XLA op / module / step lines are not kernels
                continue
            for event in line.events:
                kinds[kernel_kind(event.name)].append((event.start_ns, event.end_ns))
        out[plane.name] = kinds
    return out


def report(kernels: dict[str, dict[str, list[Interval]]]) -> dict[str, dict[str, float]]:
    """Per GPU: NCCL, GEMM and compute busy ms, and the NCCL ms under a GEMM / under any compute."""
    out = {}
    for device, kinds in sorted(kernels.items()):
        nccl, gemm = union(kinds["nccl"]), union(kinds["gemm"])
        compute = union(kinds["gemm"] + kinds["compute"])
        under_gemm, under_compute = length(intersection(nccl, gemm)), length(intersection(nccl, compute))
        nccl_ns = length(nccl)
        out[device] = {
            "kernels": sum(len(v) for v in kinds.values()),
            "nccl_ms": nccl_ns / 1e6,
            "gemm_ms": length(gemm) / 1e6,
            "compute_ms": length(compute) / 1e6,
            "overlap_ms": under_gemm / 1e6,
            "overlap_compute_ms": under_compute / 1e6,
            "nccl_under_gemm": under_gemm / nccl_ns if nccl_ns else 0.0,
        }
    return out


def trace_files(folder: str) -> list[str]:
    """The `*.xplane.pb` files under `folder` (any depth), oldest first."""
    return sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)


def report_folder(folder: str) -> dict[str, dict[str, float]]:
    """`report` of every trace file under `folder` (planes keyed `<file>:<plane>` when several)."""
    from jax.profiler import ProfileData

    files = trace_files(folder)
    if not files:
        raise FileNotFoundError(
            f"no *.xplane.pb under {folder}: was the trace written (train.profile_steps)?"
        )
    out = {}
    for path in files:
        rep = report(device_kernels(ProfileData.from_file(path)))
        prefix = f"{os.path.basename(path)}:" if len(files) > 1 else ""
        out.update({prefix + k: v for k, v in rep.items()})
    return out


def format_report(rep: dict[str, dict[str, float]]) -> str:
    if not rep:
        return "no GPU planes in the trace (a CPU run has no kernels to compare)"
    lines = []
    for device, r in rep.items():
        verdict = "CONCURRENT" if r["overlap_ms"] > 0 else "serial"
        lines.append(
            f"{device}: NCCL {r['nccl_ms']:.2f} ms, GEMM {r['gemm_ms']:.2f} ms, NCCL under GEMM "
            f"{r['overlap_ms']:.2f} ms ({100 * r['nccl_under_gemm']:.0f}%), under any compute "
            f"{r['overlap_compute_ms']:.2f} ms: {verdict}"
        )
    return "\n".join(lines)
