"""SLURM environment parsing: what one `srun` task's variables say about the launch.

Pure functions of an environment mapping; nothing here touches JAX. `xmoe_jax.launch.distributed`
resolves the launch (flags, then XMOE_* variables, then this) and starts JAX.

Inside an `srun` step (`in_slurm_step`), `from_env` gives:
  * coordinator = first host of SLURM_STEP_NODELIST (compressed lists such as
    `frontier[00001-00004,00007]` are expanded by `expand_hostlist`) and port
    XMOE_COORDINATOR_PORT, else JAX_COORDINATOR_PORT, else JAX's own job-id rule
    (61440 + job id % 4096);
  * processes = SLURM_NTASKS, process id = SLURM_PROCID;
  * this task's local devices, below.

Local devices (the part JAX's own detection gets wrong: it always picks device SLURM_LOCALID,
which does not exist when `--gpus-per-task=1` already left one visible GPU):
  * one task per node -> all local devices;
  * the task's GPUs bound by srun (`--gpus-per-task`, `--gpu-bind`: ROCR_VISIBLE_DEVICES /
    CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES lists fewer GPUs than there are tasks on the
    node, or exactly SLURM_GPUS_PER_TASK) -> all visible devices, no further restriction;
  * several tasks sharing a node's GPUs -> an equal, contiguous share per task by
    SLURM_LOCALID (one GPU/GCD each when the counts match).

Errors are `DistributedError`, defined here (the lowest layer of the launch code, so the parser
and `xmoe_jax.launch.distributed` raise the same class) and re-exported by `xmoe_jax.launch.distributed`.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping

from xmoe_jax.errors import EXIT_BAD_INPUT, XmoeError

_VISIBLE_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class DistributedError(XmoeError):
    """The multi-process launch is inconsistent or cannot start; the message names the fix."""

    exit_code = EXIT_BAD_INPUT


def parse_int(value, name: str, lo: int, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]; otherwise a DistributedError naming `name`."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name}={value!r} is not an integer") from None
    if n < lo or (hi is not None and n > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise DistributedError(f"{name}={n} must be {bound}")
    return n


# ----------------------------------------------------------------------------- lists and counts


def _expand_range(body: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0  # SLURM keeps the zero padding of `lo`
            out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            out.append(item)
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order.

    `node[001-003,007],gpu-a[1-2]b` -> node001 node002 node003 node007 gpu-a1b gpu-a2b; several
    bracket groups in one name expand to their product.
    """
    parts, depth, cur = [], 0, ""
    for ch in hostlist.strip():
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    hosts: list[str] = []
    for part in filter(None, parts):
        pieces = re.split(r"\[([^\]]*)\]", part)  # literal, bracket body, literal, ...
        choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def expand_counts(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE form: `8(x2),4` -> [8, 8, 4]."""
    out: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise DistributedError(f"cannot parse tasks per node {spec!r} from SLURM")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int_tail(value: str | None) -> int | None:
    """`1`, `gpu:1`, `a100:2` -> the count; None if unset or unparsable."""
    if not value:
        return None
    m = re.search(r"(\d+)\s*$", value)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- the step


def coordinator_port(env: Mapping[str, str]) -> int:
    """XMOE_COORDINATOR_PORT, else JAX_COORDINATOR_PORT, else JAX's rule from the job id."""
    for var in ("XMOE_COORDINATOR_PORT", "JAX_COORDINATOR_PORT"):
        if env.get(var):
            return parse_int(env[var], var, 1, 65535)
    job = int(re.match(r"\d+", env["SLURM_JOB_ID"]).group(0))
    return job % 2**12 + (65535 - 2**12 + 1)  # the rule JAX's SLURM detection uses


def in_slurm_step(env: Mapping[str, str] | None = None) -> bool:
    """True inside an `srun` step (the batch script itself is one process, not N)."""
    env = os.environ if env is None else env
    need = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST")
    return all(env.get(v) for v in need)


def device_ids(env: Mapping[str, str], tasks_per_node: int, local_id: int):
    """(local_device_ids or None, explanation) for one SLURM task; see the module docstring."""
    if tasks_per_node == 1:
        return None, "one task per node: all local devices"
    visible = {v: [x for x in env[v].split(",") if x.strip()] for v in _VISIBLE_VARS if env.get(v)}
    per_task = _int_tail(env.get("SLURM_GPUS_PER_TASK"))
    if visible:
        var, ids = min(visible.items(), key=lambda kv: len(kv[1]))
        n = len(ids)
        if n < tasks_per_node or (per_task is not None and n == per_task):
            return None, f"bound by srun: {var}={','.join(ids)} ({n} visible device(s), all used)"
        share = n // tasks_per_node
        ids_t = tuple(range(local_id * share, (local_id + 1) * share))
        return ids_t, f"{n} visible devices ({var}) shared by {tasks_per_node} tasks: {share} per task"
    gpus = _int_tail(env.get("SLURM_GPUS_ON_NODE"))
    share = max(1, gpus // tasks_per_node) if gpus else 1
    ids_t = tuple(range(local_id * share, (local_id + 1) * share))
    what = f"{gpus} GPUs on the node" if gpus else "GPU count unknown"
    return ids_t, f"{tasks_per_node} tasks per node, {what}: {share} device(s) per task by SLURM_LOCALID"


def from_env(env: Mapping[str, str]) -> dict:
    """This task's coordinator, process count and id, devices and SLURM facts (inside a step)."""
    hosts = expand_hostlist(env["SLURM_STEP_NODELIST"])
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES") or len(hosts))
    node_id = int(env.get("SLURM_NODEID") or 0)
    ntasks = int(env["SLURM_NTASKS"])
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_spec:
        counts = expand_counts(per_node_spec)
        tasks_per_node = counts[min(node_id, len(counts) - 1)]
    elif env.get("SLURM_NTASKS_PER_NODE"):
        tasks_per_node = int(env["SLURM_NTASKS_PER_NODE"])
    else:
        tasks_per_node = max(1, ntasks // max(num_nodes, 1))
    local_id = int(env.get("SLURM_LOCALID") or 0)
    ids, how = device_ids(env, tasks_per_node, local_id)
    return {
        "coordinator": f"{hosts[0]}:{coordinator_port(env)}",
        "num_processes": ntasks,
        "process_id": int(env["SLURM_PROCID"]),
        "local_device_ids": ids,
        "devices": how,
        "slurm": {
            "job_id": env["SLURM_JOB_ID"],
            "node": hosts[min(node_id, len(hosts) - 1)],
            "node_id": node_id,
            "num_nodes": num_nodes,
            "tasks_per_node": tasks_per_node,
            "local_id": local_id,
        },
    }
