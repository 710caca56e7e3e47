"""Multi-process start-up: `jax.distributed.initialize` from SLURM or explicit settings.

JAX runs one controller process per host (or per GPU); every process must call
`jax.distributed.initialize` before anything touches a device. `initialize()`
resolves the launch, checks it, and makes that call (or nothing, for one process).

Resolution, per setting, first that applies:
  1. arguments (the CLI's --coordinator, --num-processes, --process-id, --local-device-ids;
     the flags themselves are defined in `xmoe_jax.cli`);
  2. environment: XMOE_COORDINATOR (host:port), XMOE_NUM_PROCESSES, XMOE_PROCESS_ID,
     XMOE_LOCAL_DEVICE_IDS ("0,1");
  3. SLURM, inside an `srun` step: coordinator, process count and id and this task's devices
     as `xmoe_jax.launch.slurm` reads them from the step's variables (its docstring has the rules,
     including the device choice that JAX's own SLURM detection gets wrong);
  4. otherwise one process: nothing to do.

Failures end with one message naming the coordinator and the fix, never a hang: a process
other than 0 first waits (TCP) for the coordinator until `timeout_s`, and a watchdog ends a
process whose `jax.distributed.initialize` is still waiting at the deadline (JAX itself would
abort with "another task died"). Errors are `DistributedError` (from `xmoe_jax.launch.slurm`,
re-exported here).

After start-up: `share_from_main` and `gather_errors` agree on host-level decisions through
the coordination service's key-value store (no devices, nothing compiled); `shutdown()` leaves
in order (every process at JAX's shutdown barrier, then process 0 stops the service), so a
finished run prints no coordination errors. `xmoe_jax.launch.peers` watches for processes that die;
JAX's own heartbeat timeout is set above its `peer_timeout_s` so that its message comes first.

Dry runs: `python -m xmoe_jax.launch.distributed` prints this process's plan (run it under srun to see
every task's); `scripts/launch_plan.py --nodelist ... --tasks-per-node ...` models an srun launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from xmoe_jax.launch import slurm
from xmoe_jax.launch.slurm import DistributedError, parse_int  # DistributedError: re-exported

log = logging.getLogger("xmoe_jax")

DEFAULT_TIMEOUT_S = 300  # JAX's default initialization_timeout
DEFAULT_PEER_TIMEOUT_S = 60  # a silent peer is declared dead after this long (xmoe_jax.launch.peers)
JAX_HEARTBEAT_TIMEOUT_S = 100  # JAX's default
SYNC_TIMEOUT_S = 600  # host-level agreement (gather_errors, share_from_main)
WATCHDOG_EXIT_CODE = 2
_FIX = (
    "check that process 0 is running on that host and listening on that port (firewall, wrong "
    "host, port already in use), that every process was given the same coordinator, or set "
    "--coordinator HOST:PORT / XMOE_COORDINATOR (XMOE_COORDINATOR_PORT under SLURM); raise "
    "--init-timeout / XMOE_INIT_TIMEOUT for slow starts"
)  # for processes > 0; process 0 hosts the coordinator itself


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
    peer_timeout_s: int = DEFAULT_PEER_TIMEOUT_S  # xmoe_jax.launch.peers: a silent peer is dead after this

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["local_device_ids"] = list(self.local_device_ids) if self.local_device_ids is not None else None
        return d


# ----------------------------------------------------------------------------- resolution


def _parse_ids(value, name: str) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(parse_int(x, name, 0) for x in items)


def _check_coordinator(addr: str, name: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise DistributedError(f"{name}={addr!r} must be HOST:PORT, e.g. node001:61234")
    parse_int(port, f"the port of {name}", 1, 65535)
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
    peer_timeout_s: int | None = None,
) -> LaunchPlan:
    """The launch plan for this process, without touching JAX. `auto=False`: no env / SLURM."""
    env = os.environ if env is None else env
    timeout = parse_int(
        timeout_s if timeout_s is not None else env.get("XMOE_INIT_TIMEOUT", DEFAULT_TIMEOUT_S),
        "init timeout (--init-timeout / XMOE_INIT_TIMEOUT)",
        1,
    )
    peer = parse_int(
        peer_timeout_s
        if peer_timeout_s is not None
        else env.get("XMOE_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT_S),
        "peer timeout (--peer-timeout / XMOE_PEER_TIMEOUT)",
        2,
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
    step = slurm.from_env(env) if auto and slurm.in_slurm_step(env) else None

    def pick(key: str):
        for source, table in (("arguments", given), ("environment", from_env), ("slurm", step or {})):
            if table.get(key) is not None:
                return table[key], source
        return None, None

    (n, n_src), (pid, _), (addr, _), (ids, ids_src) = map(
        pick, ("num_processes", "process_id", "coordinator", "local_device_ids")
    )
    n = parse_int(n if n is not None else 1, "number of processes (--num-processes)", 1)
    if n == 1:
        ids_t = _parse_ids(ids, "--local-device-ids")
        how = "all local devices" if ids_t is None else f"devices {list(ids_t)} (--local-device-ids)"
        return LaunchPlan("single", 1, 0, None, ids_t, how, timeout, step and step["slurm"], peer)
    if pid is None:
        raise DistributedError(f"{n} processes but no process id; pass --process-id (or XMOE_PROCESS_ID)")
    pid = parse_int(pid, "process id (--process-id)", 0, n - 1)
    if addr is None:
        raise DistributedError(
            f"{n} processes but no coordinator; pass --coordinator HOST:PORT (or XMOE_COORDINATOR) "
            "naming process 0's host and a free port, the same on every process"
        )
    addr = _check_coordinator(addr, "--coordinator")
    ids_t = _parse_ids(ids, "--local-device-ids")
    if ids_src in ("slurm", None) and step is not None:
        how = step["devices"]
    else:
        how = "all local devices" if ids_t is None else f"devices {list(ids_t)} (from {ids_src})"
    return LaunchPlan(n_src, n, pid, addr, ids_t, how, timeout, step and step["slurm"], peer)


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
    peer_timeout_s: int | None = None,
) -> LaunchPlan:
    """Resolves the launch and starts `jax.distributed` (a no-op for one process).

    Call before any other JAX use (XLA flags, then this, then devices / compilation).
    Steps: resolve the plan; return if single-process or already initialised; refuse if a JAX
    backend already exists; on processes > 0 wait for the coordinator's port (clear error at the
    deadline); call `jax.distributed.initialize` with everything explicit (JAX's own cluster
    detection off) under a watchdog that ends the process with a clear message at the deadline.
    """
    p = resolve(
        coordinator,
        num_processes,
        process_id,
        local_device_ids,
        timeout_s,
        auto=auto,
        peer_timeout_s=peer_timeout_s,
    )
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
            "a JAX backend was initialised before xmoe_jax.launch.distributed.initialize(); call it first, "
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
                # xmoe_jax.launch.peers names a dead peer first; JAX's heartbeat is the backstop
                heartbeat_timeout_seconds=max(JAX_HEARTBEAT_TIMEOUT_S, 2 * p.peer_timeout_s),
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


# ----------------------------------------------------------------------------- after start-up

_uses = itertools.count()  # every process makes these calls in the same order: the n-th shares keys


def coordination_client():
    """JAX's coordination-service client, or None when `jax.distributed` is not running."""
    from jax._src import distributed as jax_distributed  # no public handle on the client

    return jax_distributed.global_state.client


def share_from_main(name: str, value: str = "") -> str:
    """Process 0's `value`, on every process (the others' `value` is ignored)."""
    import jax

    client = coordination_client()
    if client is None:
        return value
    key = f"xmoe/share/{name}/{next(_uses)}"
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    return client.blocking_key_value_get(key, SYNC_TIMEOUT_S * 1000)


def all_gather_text(name: str, value: str) -> list[str]:
    """Every process's `value`, in process order, on every process."""
    import jax

    client = coordination_client()
    if client is None:
        return [value]
    use = next(_uses)
    prefix = f"xmoe/gather/{name}/{use}/"
    client.key_value_set(prefix + str(jax.process_index()), value)
    client.wait_at_barrier(f"xmoe-gather-{name}-{use}", SYNC_TIMEOUT_S * 1000)
    values = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(prefix)}
    return [values[i] for i in range(jax.process_count())]


def barrier(name: str) -> None:
    """Returns once every process has called it (no-op without `jax.distributed`)."""
    client = coordination_client()
    if client is not None:
        client.wait_at_barrier(f"xmoe-barrier-{name}-{next(_uses)}", SYNC_TIMEOUT_S * 1000)


def compiled_together(jitted, name: str, *args):
    """`jitted` as it is with one process; with several, compiled for `args` ahead of its first run,
    after which every process waits at a barrier. A process that compiles slower (a loaded host)
    would otherwise leave the faster one waiting at the program's first collective, where the CPU
    collectives (gloo) give up after 30 s; the compiled program runs as `jitted` would."""
    import jax

    if jax.process_count() == 1:
        return jitted
    compiled = jitted.lower(*args).compile()
    barrier(name)
    return compiled


def gather_errors(name: str, error: str) -> dict[int, str]:
    """Process id -> `error` of every process whose `error` is not empty, on every process.
    Doubles as a barrier: it returns once every process has called it."""
    return {i: e for i, e in enumerate(all_gather_text(name, error)) if e}


def shutdown() -> None:
    """Leaves `jax.distributed` in order, as JAX's own exit handler does (`jax._src.api.clean_up`):
      1. wait for the work in flight and drop this process's backends (the device clients);
      2. wait at JAX's shutdown barrier until every process has arrived;
      3. process 0 stops the coordination service.
    Step 1 first because a GPU client started under `jax.distributed` keeps a thread that watches
    the other tasks through the coordination service (`WatchTasksAsync`); calling
    `jax.distributed.shutdown()` while that client lives (as this function did) left the thread
    polling a stopped service: `WatchTasksAsync failed ... Connection refused` warnings on every
    process but 0 at the end of a finished 4-GPU run. Arrays still referenced keep their client
    alive; callers drop their results' arrays first. A no-op for one process."""
    import gc

    import jax

    if not jax.distributed.is_initialized():
        return
    from jax._src import api, xla_bridge

    if xla_bridge.backends_are_initialized():
        api.clear_backends()  # effects barrier, then the backends and the compiled-function caches
        gc.collect()  # a client in a reference cycle dies now, not at interpreter exit
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------- logging


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
        f"coordinator {first['coordinator']}, init timeout {first['init_timeout_s']} s, "
        f"peer timeout {first['peer_timeout_s']} s"
    ]
    for p in plans:
        s = p["slurm"] or {}
        ids = "all visible" if p["local_device_ids"] is None else ",".join(map(str, p["local_device_ids"]))
        lines.append(
            f"  process {p['process_id']:>4}/{p['num_processes']}  node {s.get('node', '-')} "
            f"(local {s.get('local_id', 0)})  devices {ids}: {p['devices']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # `srun python -m xmoe_jax.launch.distributed`: each task prints its plan
    print(format_plan([plan()]))
