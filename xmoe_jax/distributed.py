"""Multi-process start-up: `jax.distributed.initialize` from SLURM or explicit settings.

JAX runs one controller process per host (or per GPU); every process must call
`jax.distributed.initialize` before anything touches a device. `initialize()`
resolves the launch, checks it, and makes that call (or nothing, for one process).

Resolution, per setting, first that applies:
  1. arguments (the CLI's --coordinator, --num-processes, --process-id, --local-device-ids);
  2. environment: XMOE_COORDINATOR (host:port), XMOE_NUM_PROCESSES, XMOE_PROCESS_ID,
     XMOE_LOCAL_DEVICE_IDS ("0,1");
  3. SLURM, inside an `srun` step: coordinator = first host of SLURM_STEP_NODELIST (node
     lists such as `frontier[00001-00004,00007]` are expanded) and port XMOE_COORDINATOR_PORT,
     else JAX_COORDINATOR_PORT, else JAX's own job-id rule (61440 + job id % 4096);
     processes = SLURM_NTASKS, process id = SLURM_PROCID;
  4. otherwise one process: nothing to do.

Local devices under SLURM (the part JAX's own detection gets wrong: it always picks device
SLURM_LOCALID, which does not exist when `--gpus-per-task=1` already left one visible GPU):
  * one task per node -> all local devices;
  * the task's GPUs bound by srun (`--gpus-per-task`, `--gpu-bind`: ROCR_VISIBLE_DEVICES /
    CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES lists fewer GPUs than there are tasks on the
    node, or exactly SLURM_GPUS_PER_TASK) -> all visible devices, no further restriction;
  * several tasks sharing a node's GPUs -> an equal, contiguous share per task by
    SLURM_LOCALID (one GPU/GCD each when the counts match).

Failures end with one message naming the coordinator and the fix, never a hang: a process
other than 0 first waits (TCP) for the coordinator until `timeout_s`, and a watchdog ends a
process whose `jax.distributed.initialize` is still waiting at the deadline (JAX itself would
abort with "another task died").

Dry runs: `python -m xmoe_jax.distributed` prints this process's plan (run it under srun to see
every task's); `scripts/launch_plan.py --nodelist ... --tasks-per-node ...` models an srun launch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from xmoe_jax.config import ConfigError

log = logging.getLogger("xmoe_jax")

DEFAULT_TIMEOUT_S = 300  # JAX's default initialization_timeout
WATCHDOG_EXIT_CODE = 2
_VISIBLE_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
_FIX = (
    "check that process 0 is running on that host and listening on that port (firewall, wrong "
    "host, port already in use), that every process was given the same coordinator, or set "
    "--coordinator HOST:PORT / XMOE_COORDINATOR (XMOE_COORDINATOR_PORT under SLURM); raise "
    "--init-timeout / XMOE_INIT_TIMEOUT for slow starts"
)  # for processes > 0; process 0 hosts the coordinator itself


class DistributedError(ConfigError):
    """The multi-process launch is inconsistent or cannot start; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """How this process joins the job. `local_device_ids=None`: every device it can see."""

    source: str  # "arguments", "environment", "slurm" or "single"
    num_processes: int
    process_id: int
    coordinator: str | None
    local_device_ids: tuple[int, ...] | None
    devices: str  # how the local devices were chosen, in words
    init_timeout_s: int
    slurm: dict | None = None  # job, node, node_id, num_nodes, tasks_per_node, local_id

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["local_device_ids"] = list(self.local_device_ids) if self.local_device_ids is not None else None
        return d


# ----------------------------------------------------------------------------- SLURM parsing


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


def _expand_counts(spec: str) -> list[int]:
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


def _slurm_port(env: Mapping[str, str]) -> int:
    for var in ("XMOE_COORDINATOR_PORT", "JAX_COORDINATOR_PORT"):
        if env.get(var):
            return _parse_int(env[var], var, 1, 65535)
    job = int(re.match(r"\d+", env["SLURM_JOB_ID"]).group(0))
    return job % 2**12 + (65535 - 2**12 + 1)  # the rule JAX's SLURM detection uses


def in_slurm_step(env: Mapping[str, str] | None = None) -> bool:
    """True inside an `srun` step (the batch script itself is one process, not N)."""
    env = os.environ if env is None else env
    need = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST")
    return all(env.get(v) for v in need)


def _slurm_devices(env: Mapping[str, str], tasks_per_node: int, local_id: int):
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


def _from_slurm(env: Mapping[str, str]) -> dict:
    hosts = expand_hostlist(env["SLURM_STEP_NODELIST"])
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES") or len(hosts))
    node_id = int(env.get("SLURM_NODEID") or 0)
    ntasks = int(env["SLURM_NTASKS"])
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_spec:
        counts = _expand_counts(per_node_spec)
        tasks_per_node = counts[min(node_id, len(counts) - 1)]
    elif env.get("SLURM_NTASKS_PER_NODE"):
        tasks_per_node = int(env["SLURM_NTASKS_PER_NODE"])
    else:
        tasks_per_node = max(1, ntasks // max(num_nodes, 1))
    local_id = int(env.get("SLURM_LOCALID") or 0)
    ids, how = _slurm_devices(env, tasks_per_node, local_id)
    return {
        "coordinator": f"{hosts[0]}:{_slurm_port(env)}",
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


# ----------------------------------------------------------------------------- resolution


def _parse_int(value, name: str, lo: int, hi: int | None = None) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name}={value!r} is not an integer") from None
    if n < lo or (hi is not None and n > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise DistributedError(f"{name}={n} must be {bound}")
    return n


def _parse_ids(value, name: str) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(_parse_int(x, name, 0) for x in items)


def _check_coordinator(addr: str, name: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise DistributedError(f"{name}={addr!r} must be HOST:PORT, e.g. node001:61234")
    _parse_int(port, f"the port of {name}", 1, 65535)
    return addr


def resolve(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | str | None = None,
    timeout_s: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    auto: bool = True,
) -> LaunchPlan:
    """The launch plan for this process, without touching JAX. `auto=False`: no env / SLURM."""
    env = os.environ if env is None else env
    timeout = _parse_int(
        timeout_s if timeout_s is not None else env.get("XMOE_INIT_TIMEOUT", DEFAULT_TIMEOUT_S),
        "init timeout (--init-timeout / XMOE_INIT_TIMEOUT)",
        1,
    )
    given = {
        "coordinator": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_device_ids": local_device_ids,
    }
    from_env = {}
    if auto:
        names = ("XMOE_COORDINATOR", "XMOE_NUM_PROCESSES", "XMOE_PROCESS_ID", "XMOE_LOCAL_DEVICE_IDS")
        from_env = {k: env[n] for k, n in zip(given, names, strict=True) if env.get(n)}
    slurm = _from_slurm(env) if auto and in_slurm_step(env) else None

    def pick(key: str):
        for source, table in (("arguments", given), ("environment", from_env), ("slurm", slurm or {})):
            if table.get(key) is not None:
                return table[key], source
        return None, None

    (n, n_src), (pid, _), (addr, _), (ids, ids_src) = map(
        pick, ("num_processes", "process_id", "coordinator", "local_device_ids")
    )
    n = _parse_int(n if n is not None else 1, "number of processes (--num-processes)", 1)
    if n == 1:
        ids_t = _parse_ids(ids, "--local-device-ids")
        how = "all local devices" if ids_t is None else f"devices {list(ids_t)} (--local-device-ids)"
        return LaunchPlan("single", 1, 0, None, ids_t, how, timeout, slurm and slurm["slurm"])
    if pid is None:
        raise DistributedError(f"{n} processes but no process id; pass --process-id (or XMOE_PROCESS_ID)")
    pid = _parse_int(pid, "process id (--process-id)", 0, n - 1)
    if addr is None:
        raise DistributedError(
            f"{n} processes but no coordinator; pass --coordinator HOST:PORT (or XMOE_COORDINATOR) "
            "naming process 0's host and a free port, the same on every process"
        )
    addr = _check_coordinator(addr, "--coordinator")
    ids_t = _parse_ids(ids, "--local-device-ids")
    if ids_src in ("slurm", None) and slurm is not None:
        how = slurm["devices"]
    else:
        how = "all local devices" if ids_t is None else f"devices {list(ids_t)} (from {ids_src})"
    return LaunchPlan(n_src, n, pid, addr, ids_t, how, timeout, slurm and slurm["slurm"])


def plan(*args, **kwargs) -> dict:
    """`resolve(...)` as a plain dict (dry runs, launch scripts, logs). Initialises nothing."""
    return resolve(*args, **kwargs).as_dict()


# ----------------------------------------------------------------------------- start-up


def _wait_for_coordinator(p: LaunchPlan, deadline: float) -> None:
    """Polls process 0's port so an unreachable coordinator is a Python error, not a C++ abort."""
    host, _, port = p.coordinator.rpartition(":")
    host = host.strip("[]")
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"process {p.process_id} of {p.num_processes} could not reach the coordinator at "
                f"{p.coordinator} within {p.init_timeout_s} s ({last}); {_FIX}"
            )
        time.sleep(0.25)


@contextlib.contextmanager
def _watchdog(deadline: float, message: str):
    """Ends the process with `message` if the block is still running at `deadline`."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
            os._exit(WATCHDOG_EXIT_CODE)

    thread = threading.Thread(target=watch, name="xmoe-init-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | str | None = None,
    timeout_s: int | None = None,
    *,
    auto: bool = True,
) -> LaunchPlan:
    """Resolves the launch and starts `jax.distributed` (a no-op for one process).

    Call before any other JAX use (XLA flags, then this, then devices / compilation).
    Steps: resolve the plan; return if single-process or already initialised; refuse if a JAX
    backend already exists; on processes > 0 wait for the coordinator's port (clear error at the
    deadline); call `jax.distributed.initialize` with everything explicit (JAX's own cluster
    detection off) under a watchdog that ends the process with a clear message at the deadline.
    """
    p = resolve(coordinator, num_processes, process_id, local_device_ids, timeout_s, auto=auto)
    import jax
    from jax._src import xla_bridge

    if jax.distributed.is_initialized():
        return p
    if not p.is_multi_process:
        if p.local_device_ids is not None and not xla_bridge.backends_are_initialized():
            visible = ",".join(map(str, p.local_device_ids))  # what jax.distributed would set
            jax.config.update("jax_cuda_visible_devices", visible)
            jax.config.update("jax_rocm_visible_devices", visible)
        return p
    if xla_bridge.backends_are_initialized():
        raise DistributedError(
            "a JAX backend was initialised before xmoe_jax.distributed.initialize(); call it first, "
            "before anything that touches devices (jax.devices(), arrays, jit)"
        )
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU multi-process
    deadline = time.monotonic() + p.init_timeout_s
    if p.process_id != 0:
        _wait_for_coordinator(p, deadline)
    port = p.coordinator.rpartition(":")[2]
    waiting = (
        f"process {p.process_id}: not all {p.num_processes} processes joined the coordinator at "
        f"{p.coordinator} within {p.init_timeout_s} s; check that all {p.num_processes} tasks started "
        f"(srun -n {p.num_processes}) with the same coordinator and process count and can reach that "
        f"host on port {port}, or raise --init-timeout / XMOE_INIT_TIMEOUT for slow starts"
    )
    remaining = max(1, int(deadline - time.monotonic()))
    try:
        with _watchdog(deadline, waiting):
            jax.distributed.initialize(
                coordinator_address=p.coordinator,
                num_processes=p.num_processes,
                process_id=p.process_id,
                local_device_ids=list(p.local_device_ids) if p.local_device_ids is not None else None,
                cluster_detection_method="deactivate",  # everything is explicit; see module docstring
                initialization_timeout=remaining + 30,  # the watchdog speaks first
            )
    except Exception as e:  # JaxRuntimeError (e.g. "Failed to start RPC server") and friends
        hint = f"port {port} may be in use: pick another" if p.process_id == 0 else _FIX
        raise DistributedError(
            f"process {p.process_id} of {p.num_processes}: jax.distributed.initialize with coordinator "
            f"{p.coordinator} failed ({type(e).__name__}: {e}); {hint} (--coordinator HOST:PORT, "
            "XMOE_COORDINATOR or XMOE_COORDINATOR_PORT)"
        ) from e
    if p.process_id == 0:
        log.info(
            "jax.distributed: %d processes, coordinator %s (%s); process 0 devices: %s",
            p.num_processes,
            p.coordinator,
            p.source,
            p.devices,
        )
    return p


# ----------------------------------------------------------------------------- CLI helpers


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """The launch flags of `xmoe-train` (all optional; SLURM is detected without them)."""
    g = parser.add_argument_group("multi-process (default: detect SLURM srun steps, else one process)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env XMOE_COORDINATOR)")
    g.add_argument("--num-processes", type=int, metavar="N", help="total processes (env XMOE_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env XMOE_PROCESS_ID)")
    g.add_argument(
        "--local-device-ids", metavar="0,1", help="devices this process uses (env XMOE_LOCAL_DEVICE_IDS)"
    )
    g.add_argument(
        "--init-timeout",
        type=int,
        metavar="S",
        help=f"seconds to wait for all processes (env XMOE_INIT_TIMEOUT, default {DEFAULT_TIMEOUT_S})",
    )
    g.add_argument(
        "--no-distributed",
        action="store_true",
        help="one process: ignore SLURM and XMOE_* launch variables (env XMOE_DISTRIBUTED=0)",
    )


def initialize_from_args(args: argparse.Namespace) -> LaunchPlan:
    """`initialize()` from the flags of `add_cli_flags`; `--no-distributed` forces one process."""
    off = args.no_distributed or os.environ.get("XMOE_DISTRIBUTED", "1").lower() in ("0", "false", "no")
    if off and (args.coordinator or args.num_processes or args.process_id is not None):
        raise DistributedError("--no-distributed conflicts with --coordinator/--num-processes/--process-id")
    return initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        args.local_device_ids,
        args.init_timeout,
        auto=not off,
    )


def quiet_unless_main(p: LaunchPlan) -> None:
    """Process 0 logs; the others report errors only, tagged with their process id."""
    if p.process_id == 0:
        return
    logging.getLogger("xmoe_jax").setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(
            logging.Formatter(f"%(levelname)s [process {p.process_id}] %(name)s: %(message)s")
        )


# ----------------------------------------------------------------------------- dry runs


def format_plan(plans: Sequence[dict]) -> str:
    """Human-readable launch plan: a header, then one line per process."""
    first = plans[0]
    lines = [
        f"launch plan: {first['num_processes']} process(es), source {first['source']}, "
        f"coordinator {first['coordinator']}, init timeout {first['init_timeout_s']} s"
    ]
    for p in plans:
        s = p["slurm"] or {}
        ids = "all visible" if p["local_device_ids"] is None else ",".join(map(str, p["local_device_ids"]))
        lines.append(
            f"  process {p['process_id']:>4}/{p['num_processes']}  node {s.get('node', '-')} "
            f"(local {s.get('local_id', 0)})  devices {ids}: {p['devices']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # `srun python -m xmoe_jax.distributed`: each task prints its plan
    print(format_plan([plan()]))
