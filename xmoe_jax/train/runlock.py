"""The run directory's lock: writable, one writer at a time (the paths are `rundir.RunDir`'s).

`claim(run_dir)` runs before anything compiles:
  1. the directory must be a directory we can write (a file, or a read-only or forbidden
     path, is a `ConfigError` naming the path and the fix);
  2. process 0 takes the lock `<run_dir>/run.lock` (`RunLock.acquire`, below) and every process
     learns the outcome.

How `acquire` excludes a second holder (two mechanisms; the kernel's is the one that decides):
  1. open `run.lock` (created if absent) and take an exclusive advisory lock on it, `flock`,
     without waiting. The kernel holds it for as long as the file stays open, which is the
     process's lifetime, and drops it when the process dies, however it dies. Busy: another
     process holds the run; refused, naming the holder its record describes.
  2. check that the path still names the file we locked (a holder that released unlinks the file
     while it still holds the lock, so a taker that opened it before sees another inode and
     tries again).
  3. read the record the file holds: host, pid, PID namespace, boot id, process start time, SLURM
     job, command. Empty (a first start, or a taker that died before writing): ours. A holder
     that is provably gone (`_stale_reason`: on this host, PID namespace and boot its pid no
     longer runs, or runs another program; an earlier run of this SLURM job; not refreshed for
     `STALE_AFTER_S` seconds): ours, with a warning naming why. A holder that may still run,
     though the kernel says nobody holds the lock: refused (a file system whose locks are not
     seen across nodes, or an older xmoe_jax without the lock; see below).
  4. write our record into the file we hold, and refresh its time stamp every `REFRESH_S` s.
A takeover is step 1's lock, which one process at most holds at a time: there is no rename,
and no moment in which the path is free to a third trainer, so no interleaving of any number of
contenders yields two holders. `release` unlinks the file before it closes it (step 2).

Which file systems are trusted:
  - local (ext4, xfs, tmpfs, overlayfs): `flock` is exact; the record only names the holder.
  - NFS (v4, or v3 with lockd running): Linux sends `flock` to the server as a whole-file POSIX
    lock, seen by every client. A client that dies keeps it until the server's lease expires
    (v4: about 90 s) or, on v3, until that node restarts; meanwhile a trainer is refused naming
    the holder, and removing `run.lock` frees the run. POSIX semantics also mean that any close
    of the file by the holder's process drops the lock, so the holder never opens it twice.
  - Lustre: mounted with `-o flock`, cluster-coherent like NFS. `-o localflock` lies: the lock
    is seen on one node only; trainers on two nodes are then kept apart by step 3's record,
    which holds once the first has written it (milliseconds after it starts), but not for two
    started at the same instant. `-o noflock` (and any file system that refuses `flock`):
    one warning, and the record alone decides: a fresh lock is created with O_EXCL (atomic on
    NFS and Lustre), and a stale one is never taken over automatically (that takeover has a
    window no rename closes), so the message asks the user to remove it.
A file system that claims to lock and does not (NFS mounted with `nolock` or `local_lock=all`)
is the `localflock` case above.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
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


# errors of a file system that does not do `flock` (Lustre -o noflock, some FUSE mounts, NFS
# without lockd); ENOTSUP is EOPNOTSUPP on Linux
_NO_LOCKS = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL})
_RETRIES = 10


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _parse(raw: bytes) -> dict | None:
    """The holder a lock file records; {} when empty, None when half-written (not a JSON object)."""
    if not raw.strip():
        return {}
    try:
        holder = json.loads(raw)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _read_fd(fd: int) -> tuple[dict | None, float]:
    """The record of the open lock file and its age in seconds; read through `fd`: on NFS, where
    `flock` is a POSIX lock, closing any other descriptor of the file would drop our lock."""
    return _parse(os.pread(fd, 1 << 16, 0)), time.time() - os.fstat(fd).st_mtime


class RunLock:
    """`<run_dir>/run.lock`, held while this process trains in `run_dir` (see the module docstring).
    Other writers of a folder (`xmoe-tokenize`, `xmoe-convert export`) name their own lock file
    (`path`), the program that holds it (`user`) and the other choice (`fix`) for the refusal's
    message. One `RunLock` per path and process: on NFS two in one process do not exclude each other."""

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
        self._fd: int | None = None
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self) -> None:
        """Takes the lock (steps 1-4 of the module docstring) or raises `ConfigError` naming its holder."""
        for _ in range(_RETRIES):  # a retry follows a holder's release between our open and our lock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                except FileNotFoundError:
                    continue  # released meanwhile
                except PermissionError:  # another user's lock: it cannot be ours
                    raise self._refusal(*self._read_path(), busy=True) from None
                created = False
            try:
                held = self._take(fd, created)
            except BaseException:
                os.close(fd)
                raise
            if held:
                self._fd, self._held = fd, True
                self._stop.clear()
                self._thread = threading.Thread(target=self._refresh, name="xmoe-run-lock", daemon=True)
                self._thread.start()
                return
            os.close(fd)
        raise ConfigError(
            f"could not take the lock {self.path}: it was replaced {_RETRIES} times meanwhile; try again"
        )

    def _take(self, fd: int, created: bool) -> bool:
        """Steps 1-4 on the open lock file: True when it is ours, False to try again, else refused."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the kernel says a live process holds it
            raise self._refusal(*_read_fd(fd), busy=True) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            return self._take_without_locks(fd, created, e)
        if not _same_file(fd, self.path):
            return False  # its holder released (unlinked) it after our open: try the new one
        holder, age = _read_fd(fd)
        if holder is None:
            log.warning(
                "took over the lock %s: its record was half-written (a process killed as it started)",
                self.path,
            )
        elif holder:
            reason = _stale_reason(holder, age)
            if reason is None:  # free to the kernel, yet its record names a holder that may run
                raise self._refusal(holder, age)
            log.warning("took over the lock %s: %s", self.path, reason)
        self._write(fd)
        return True

    def _take_without_locks(self, fd: int, created: bool, e: OSError) -> bool:
        """A file system that refuses `flock`: the record alone decides, and nothing is taken over."""
        log.warning(
            "%s: the file system refuses locks (flock: %s); the lock's record alone keeps a second writer "
            "out, and a stale lock is not taken over (on Lustre, mount with -o flock)",
            self.path,
            e.strerror,
        )
        if created:  # O_EXCL: only one creator
            self._write(fd)
            return True
        holder, age = _read_fd(fd)
        if not holder:
            holder = {}  # empty or half-written: described as such
        reason = _stale_reason(holder, age) if holder else ("unreadable" if age > 10 else None)
        if reason is None:
            raise self._refusal(holder, age)
        raise ConfigError(
            f"{self.path.parent} has a stale lock ({reason}), and its file system refuses locks "
            f"(flock: {e.strerror}), so it is not taken over automatically: make sure no other process "
            f"uses {self.path.parent}, then remove {self.path} and start again"
        )

    def _read_path(self) -> tuple[dict, float]:
        try:
            holder = _parse(self.path.read_bytes())
            age = time.time() - os.stat(self.path).st_mtime
        except OSError:
            return {}, 0.0
        return holder or {}, age

    def _refusal(self, holder: dict | None, age: float, busy: bool = False) -> ConfigError:
        holder = holder or {}
        who = _describe(holder, age)
        reason = _stale_reason(holder, age) if holder and busy else None
        if reason is not None:  # its record is out of date, yet the kernel's lock is held
            who = (
                f"a process holding the lock, whose record still names {who}, although {reason} "
                "(another taker right now, or a failed node whose NFS lock outlives it)"
            )
        return ConfigError(
            f"{self.path.parent} is in use by {self._user}: {who}. Wait for it to finish, stop it, "
            f"or {self._fix}; if that process is gone (for example its node failed), remove {self.path}"
        )

    def _write(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(OSError, TypeError):
                os.utime(self._fd)  # through the descriptor: never a second open (see `_read_fd`)

    def release(self) -> None:
        """Unlinks the file while still holding its lock, then closes it (the lock goes with it)."""
        if not self._held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        fd, self._fd, self._held = self._fd, None, False
        with contextlib.suppress(OSError):
            if _same_file(fd, self.path):
                self.path.unlink()
        os.close(fd)


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
