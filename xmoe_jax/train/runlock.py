"""The run directory's lock: writable, one writer at a time (the paths are `rundir.RunDir`'s).

`claim(run_dir)` runs before anything compiles:
  1. the directory must be a directory we can write (a file, or a read-only or forbidden
     path, is a `ConfigError` naming the path and the fix);
  2. process 0 takes the lock `<run_dir>/run.lock` (created with O_EXCL; it holds the
     holder's host, pid, PID namespace, boot id, process start time and SLURM job) and
     refreshes its time stamp every `REFRESH_S` seconds from a daemon thread; every process
     learns the outcome.
A lock is stale, and is taken over with a warning, when its holder is provably gone: on this
host, in this PID namespace and boot, its pid no longer runs (or runs another program: the
start time differs); it belongs to an earlier run of this same SLURM job (a requeue); or it has
not been refreshed for `STALE_AFTER_S` seconds (the only test for a holder on another host, in
another PID namespace or before a reboot: a pid means nothing there). Otherwise the second
trainer stops, naming the holder.
The takeover is a compare-and-swap (`_take_over`): rename the stale file to a name of our own,
check it is the very file judged stale (inode, time stamp, content), else put it back; so of
several trainers that find one stale lock at once exactly one removes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from xmoe_jax.config import ConfigError
from xmoe_jax.launch import distributed
from xmoe_jax.train import writable
from xmoe_jax.train.rundir import RunDir

log = logging.getLogger("xmoe_jax")

REFRESH_S = 30.0
STALE_AFTER_S = 300.0


# ----------------------------------------------------------------------------- checks


def check_writable(run_dir: Path, name: str = "train.run_dir") -> None:
    """Creates `run_dir` if needed and proves it writable; a `ConfigError` names what is wrong."""
    fix = "set train.run_dir to a writable directory"
    where = f"train.run_dir={run_dir}" if name == "train.run_dir" else f"{name} {run_dir}"
    for parent in (run_dir, *run_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{where}: {parent} is a file, not a directory; {fix}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        writable.probe_write(run_dir)
    except OSError as e:
        if name != "train.run_dir":
            fix = "fix its permissions or mount (a read-only or full file system?), or " + fix
        raise ConfigError(f"{where} is not writable ({e.strerror or e}); {fix}") from e


# ----------------------------------------------------------------------------- the lock


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 counted from the pid


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_or_none(read) -> str | None:
    try:
        return read()
    except OSError:
        return None


def _namespace() -> dict:
    """This process's PID namespace and the kernel's boot: a pid is only comparable within both."""
    return {
        "pid_ns": _read_or_none(lambda: os.readlink("/proc/self/ns/pid")),
        "boot_id": _read_or_none(lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
    }


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **_namespace(),
        "start_time": _start_time(os.getpid()),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "command": " ".join(sys.argv)[:300],
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _stale_reason(holder: dict, age_s: float) -> str | None:
    """Why the lock's holder is provably gone, or None if it may still run."""
    me = _me()
    same_pids = all(holder.get(k) is not None and holder.get(k) == me[k] for k in ("pid_ns", "boot_id"))
    if holder.get("host") == me["host"] and same_pids:  # elsewhere a pid means nothing: the age decides
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _pid_alive(pid):
            return f"its process {pid} no longer runs"
        started = _start_time(pid)
        if holder.get("start_time") and started and started != holder["start_time"]:
            return f"pid {pid} now belongs to another process"
        return None
    if me["slurm_job"] and holder.get("slurm_job") == me["slurm_job"]:
        if int(holder.get("slurm_restart") or 0) < me["slurm_restart"]:
            return "it belongs to an earlier run of this SLURM job (requeued)"
    if age_s > STALE_AFTER_S:
        return f"its holder on {holder.get('host')} has not refreshed it for {age_s:.0f} s"
    return None


def _describe(holder: dict, age_s: float) -> str:
    if not holder:
        return f"an empty or half-written lock (a trainer starting now, or one killed as it started), modified {age_s:.0f} s ago"
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}{job}, running since {holder.get('since')} "
        f"({holder.get('command', '?')!r}); lock refreshed {age_s:.0f} s ago"
    )


class RunLock:
    """`<run_dir>/run.lock`, held while this process trains in `run_dir` (see the module docstring).
    Other writers of a folder (`xmoe-tokenize`) name their own lock file (`path`), the program that
    holds it (`user`) and the other choice (`fix`) for the refusal's message."""

    def __init__(
        self,
        run_dir: Path,
        path: Path | None = None,
        user: str = "another trainer",
        fix: str = "set train.run_dir to another directory",
    ):
        self.path = path if path is not None else RunDir(run_dir).lock
        self._user, self._fix = user, fix
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False

    def acquire(self) -> None:
        """Takes the lock or raises `ConfigError` naming its holder."""
        for _ in range(3):  # a takeover races at most with other takeovers
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(_me(), f)
            self._held = True
            self._thread = threading.Thread(target=self._refresh, name="xmoe-run-lock", daemon=True)
            self._thread.start()
            return
        raise ConfigError(f"could not take the lock {self.path}; try again")

    def _take_over_if_stale(self) -> None:
        try:
            raw = self.path.read_bytes()
            seen = os.stat(self.path)
        except FileNotFoundError:
            return  # released meanwhile: try again
        age = time.time() - seen.st_mtime
        try:
            holder = json.loads(raw)
            holder = holder if isinstance(holder, dict) else {}
        except ValueError:
            holder = {}  # half-written: judge by age
        reason = _stale_reason(holder, age) if holder else ("unreadable" if age > 10 else None)
        if reason is None:
            raise ConfigError(
                f"{self.path.parent} is in use by {self._user}: {_describe(holder, age)}. Wait for it "
                f"to finish, stop it, or {self._fix}; if that process is gone "
                f"(for example its node failed), remove {self.path}"
            )
        if self._take_over(raw, seen):
            log.warning("took over the run directory lock %s: %s", self.path, reason)

    def _take_over(self, raw: bytes, seen: os.stat_result) -> bool:
        """Removes the stale lock only if `path` still is the file judged stale (compare-and-swap):
        rename it to a name of our own, compare, and put back a file that is not it."""
        aside = self.path.with_name(
            f"{self.path.name}.stale.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"
        )
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # another taker removed it first
        got = os.stat(aside)
        same = (got.st_dev, got.st_ino, got.st_mtime_ns) == (seen.st_dev, seen.st_ino, seen.st_mtime_ns)
        if same and aside.read_bytes() == raw:
            aside.unlink()
            return True
        try:  # a fresh lock another trainer made (or the holder refreshed it): put it back, never over another
            os.link(aside, self.path)
        except FileExistsError:
            log.error(
                "%s: moved a live trainer's lock aside while a third trainer took the lock; two trainers "
                "may now share %s (see %s)",
                self.path,
                self.path.parent,
                aside,
            )
            return False
        aside.unlink()
        return False

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        if not self._held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        self._held = False


def claim(run_dir: Path, is_main: bool, checkpoints: Path | None = None) -> RunLock:
    """Checks `run_dir` (and the `checkpoints` folder, if given) on every process and takes the lock
    on process 0; if any of that fails, every process raises a `ConfigError` naming it. Release the
    returned lock when the run ends."""
    lock = RunLock(run_dir)
    error = ""
    try:
        check_writable(run_dir)
        if is_main:
            lock.acquire()
        if checkpoints is not None:  # a read-only checkpoints/ would otherwise surface at the first save
            check_writable(checkpoints, "the checkpoint folder")
    except ConfigError as e:
        error = str(e)
    errors = distributed.gather_errors("run-dir", error)
    if errors:
        lock.release()
        raise ConfigError(error or "; ".join(f"process {i}: {e}" for i, e in sorted(errors.items())))
    return lock
