"""The run directory: one writer at a time (a lock a dead process does not leave stuck), a clear
error before compiling for a run directory that is a file or not writable, and metrics.jsonl
trimmed to the resumed step."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from xmoe_jax.cli import train_main
from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.train import rundir, runlock
from xmoe_jax.train.loop import train
from xmoe_jax.train.rundir import RunDir

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
HOLD = (
    "import sys, time, pathlib; from xmoe_jax.train.runlock import RunLock; "
    "RunLock(pathlib.Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(120)"
)


@pytest.fixture
def holder(tmp_path):
    """Another process that holds the lock of `tmp_path / 'run'`."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield run, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_second_trainer_stops_naming_the_other_then_takes_over_once_it_died(holder, capsys, caplog):
    run, proc = holder
    argv = ["--config", str(TINY), "--set", f"train.run_dir={run}", "--set", "train.steps=2"]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert f"{run} is in use by another trainer: pid {proc.pid} on host {socket.gethostname()}" in err
    assert f"remove {run / 'run.lock'}" in err and len(err.strip().splitlines()) == 1
    assert not (run / "checkpoints").exists()  # stopped before anything else
    proc.kill()
    proc.wait(timeout=30)
    lock = runlock.claim(run, is_main=True)  # the dead holder's lock is stale
    assert f"its process {proc.pid} no longer runs" in caplog.text
    assert json.loads((run / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / "run.lock").exists()


def test_lock_of_a_reused_pid_or_an_earlier_slurm_run_is_stale(tmp_path, monkeypatch):
    me = runlock._me()
    assert (
        runlock._stale_reason({**me, "start_time": "1"}, 0)
        == f"pid {me['pid']} now belongs to another process"
    )
    assert runlock._stale_reason(me, 0) is None  # this very process: live
    other = {**me, "host": "elsewhere", "slurm_job": "77", "slurm_restart": 0}
    assert runlock._stale_reason(other, 10) is None
    assert "not refreshed" in runlock._stale_reason(other, runlock.STALE_AFTER_S + 1)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert "earlier run of this SLURM job" in runlock._stale_reason(other, 10)


def test_run_dir_that_is_a_file_or_not_writable_fails_before_compiling(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for run_dir, message in (
        (afile, "is a file, not a directory"),
        (afile / "run", "is a file, not a directory"),
    ):
        cfg = load_config(TINY, [f"train.run_dir={run_dir}", "train.steps=1"])
        with pytest.raises(ConfigError, match=message):
            train(cfg)
    with pytest.raises(ConfigError, match="is not writable"):  # sysfs refuses mkdir, even to root
        train(load_config(TINY, ["train.run_dir=/sys/xmoe-run", "train.steps=1"]))
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=f"train.run_dir={ro / 'run'} is not writable"):
            train(load_config(TINY, [f"train.run_dir={ro / 'run'}", "train.steps=1"]))


def test_metrics_after_the_resumed_step_move_aside(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 7, "lo')  # torn by a kill
    RunDir(tmp_path).trim_metrics(4)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:4])
    discarded = (tmp_path / rundir.DISCARDED_METRICS).read_text().splitlines()
    assert discarded[:2] == [line.strip() for line in lines[4:]] and discarded[2] == '{"step": 7, "lo'
    RunDir(tmp_path).trim_metrics(4)  # nothing more to move
    assert len((tmp_path / rundir.DISCARDED_METRICS).read_text().splitlines()) == 3


# ----------------------------------------------------------------------------- issue 23


def _stale_lock(run: pathlib.Path, **fields) -> None:
    """A lock of a process that is gone (pid 2**22 + 1 exceeds pid_max), last refreshed 20 min ago."""
    holder = {**runlock._me(), "pid": 2**22 + 1, "start_time": "1", **fields}
    (run / rundir.LOCK_NAME).write_text(json.dumps(holder))
    old = os.stat(run / rundir.LOCK_NAME).st_mtime - 1200
    os.utime(run / rundir.LOCK_NAME, (old, old))


def test_two_takers_of_a_stale_lock_race_and_exactly_one_wins(tmp_path, monkeypatch):
    """Issue 23 2.3: two trainers find a dead holder's lock at once; each used to replace and unlink
    "the stale lock", so the slower one removed the faster one's fresh lock and both trained."""
    import random
    import threading
    import time

    monkeypatch.setattr(runlock.log, "warning", lambda *a, **k: None)
    real_stale = runlock._stale_reason

    def slow_judge(holder, age_s):  # widen the window between judging and replacing, as a slow disk does
        reason = real_stale(holder, age_s)
        time.sleep(random.random() * 2e-3)
        return reason

    monkeypatch.setattr(runlock, "_stale_reason", slow_judge)
    trials, start = 120, time.perf_counter()
    for trial in range(trials):
        run = tmp_path / f"r{trial}"
        run.mkdir()
        _stale_lock(run)
        gate, won, refused = threading.Barrier(2), [], []

        def take(run=run, gate=gate, won=won, refused=refused):
            lock = runlock.RunLock(run)
            gate.wait()
            try:
                lock.acquire()
                won.append(lock)
            except ConfigError as e:
                refused.append(str(e))

        threads = [threading.Thread(target=take) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for lock in won:
            lock._stop.set()
        assert len(won) == 1 and len(refused) == 1, (trial, len(won), refused)
        assert "is in use by another trainer" in refused[0]
        assert json.loads((run / rundir.LOCK_NAME).read_text())["pid"] == os.getpid()
        assert sorted(p.name for p in run.iterdir()) == [rundir.LOCK_NAME]  # nothing left aside
    assert time.perf_counter() - start < 30


def test_a_live_lock_from_another_pid_namespace_or_boot_is_judged_by_its_age(tmp_path):
    """Issue 23 2.4: a trainer inside `unshare --pid` (or a container sharing the host name) records
    pid 1; outside, that pid is another process, so its live lock looked stale."""
    me = runlock._me()
    assert me["pid_ns"].startswith("pid:[") and len(me["boot_id"]) == 36
    gone = {**me, "pid": 2**22 + 1, "start_time": "1"}
    assert "no longer runs" in runlock._stale_reason(gone, 0)  # same namespace and boot: the pid test
    for other in ({"pid_ns": "pid:[1]"}, {"boot_id": "0" * 36}, {"pid_ns": None, "boot_id": None}):
        assert runlock._stale_reason({**gone, **other}, 10) is None  # refreshed 10 s ago: may live
        assert "not refreshed" in runlock._stale_reason({**gone, **other}, runlock.STALE_AFTER_S + 1)
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.LOCK_NAME).write_text(json.dumps({**gone, "pid": 1, "pid_ns": "pid:[1]"}))
    with pytest.raises(ConfigError, match="is in use by another trainer: pid 1 on host"):
        runlock.RunLock(run).acquire()


def test_an_empty_lock_is_described_as_such(tmp_path):
    """Issue 23 2.11: an empty (half-written) lock said "pid None on host None". Issue 38: an empty
    file that nobody locks is a taker killed before it wrote: taken; one a live process locks is a
    taker writing now: refused, described as such."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.LOCK_NAME).write_text("")
    fd = os.open(run / rundir.LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a contender between its lock and its record
    try:
        with pytest.raises(ConfigError) as e:
            runlock.RunLock(run).acquire()
        assert "None" not in str(e.value) and "empty or half-written" in str(e.value)
    finally:
        os.close(fd)
    lock = runlock.RunLock(run)
    lock.acquire()  # nobody holds it now
    assert json.loads((run / rundir.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_checkpoints_folder_that_cannot_be_written_fails_before_compiling(tmp_path, monkeypatch):
    """Issue 23 2.1: a read-only `checkpoints/` blocked the trainer at its first save for 5 minutes.
    Root writes through permission bits, so the read-only mount is simulated: `checkpoints` is a
    file, then the probe's create fails with EROFS (what a read-only mount answers)."""
    import errno

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("x")
    cfg = load_config(TINY, [f"train.run_dir={run}", "train.steps=1"])
    with pytest.raises(ConfigError, match=f"{run / 'checkpoints'} is a file, not a directory"):
        train(cfg)
    (run / "checkpoints").unlink()
    (run / "checkpoints").mkdir()
    real_open = os.open

    def read_only(path, flags, *a):
        if str(path).startswith(str(run / "checkpoints")) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=f"{run / 'checkpoints'} is not writable .Read-only file system."):
        train(cfg)
    assert not (run / rundir.LOCK_NAME).exists()  # released


# ----------------------------------------------------------------------------- issue 38


def _takers(run: pathlib.Path, n: int) -> list[runlock.RunLock]:
    return [runlock.RunLock(run) for _ in range(n)]


def _outcome(lock: runlock.RunLock) -> str:
    try:
        lock.acquire()
    except ConfigError as e:
        assert "is in use by another trainer" in str(e), e
        return "refused"
    return "held"


def test_the_interleaving_of_issue_38_gives_one_holder(tmp_path, monkeypatch, caplog):
    """Issue 38: A and B read one stale lock; A takes it; B, behind, moved A's fresh lock aside; C
    took the empty path; A and C both trained. Forced here: the first judge of the stale lock (B)
    waits while A takes the lock, and any rename of the lock file lets C start at once."""
    run = tmp_path / "run"
    run.mkdir()
    _stale_lock(run)
    a, b, c = _takers(run, 3)
    outcome: dict[str, str] = {}
    real_stale, real_rename = runlock._stale_reason, os.rename

    def judge(holder, age_s):  # B has read the stale lock: A overtakes it
        reason = real_stale(holder, age_s)
        if "a" not in outcome:
            outcome["a"] = "running"
            outcome["a"] = _outcome(a)
        return reason

    def rename(src, dst, *args, **kw):  # B moves the lock file aside: C takes the path meanwhile
        real_rename(src, dst, *args, **kw)
        if pathlib.Path(src) == run / rundir.LOCK_NAME and outcome.get("a") in ("held", "refused"):
            outcome.setdefault("c", _outcome(c))

    monkeypatch.setattr(runlock, "_stale_reason", judge)
    monkeypatch.setattr(os, "rename", rename)
    outcome["b"] = _outcome(b)
    outcome.setdefault("c", _outcome(c))
    held = [k for k in "abc" if outcome[k] == "held"]
    assert len(held) == 1, (outcome, caplog.text)
    assert "may now share" not in caplog.text
    assert [p.name for p in run.iterdir()] == [rundir.LOCK_NAME]
    for lock in (a, b, c):
        lock.release()
    assert not (run / rundir.LOCK_NAME).exists()


def test_a_release_between_a_takers_open_and_its_lock_is_retried(tmp_path, monkeypatch):
    """The window of a lock on a file that is unlinked at release: B opens the file, A releases
    (unlinks it) and C creates a new one; B's lock on the unlinked file must not count."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    a, b, c = _takers(run, 3)
    a.acquire()
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:  # B's first lock: A releases, C takes the path, before B's call lands
            a.release()
            c.acquire()
        return real_flock(fd, op)

    monkeypatch.setattr(runlock.fcntl, "flock", flock)
    with pytest.raises(ConfigError, match="is in use by another trainer"):
        b.acquire()
    assert c.held and not b.held and not a.held
    c.release()


def test_a_file_system_without_locks_never_takes_over(tmp_path, monkeypatch, caplog):
    """Lustre -o noflock refuses flock (ENOSYS): the O_EXCL record alone keeps a second writer out,
    and a stale lock is left to the user rather than taken through a window."""
    import errno

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    first = runlock.RunLock(run)
    first.acquire()
    assert "refuses locks" in caplog.text
    with pytest.raises(ConfigError, match="is in use by another trainer"):
        runlock.RunLock(run).acquire()
    first.release()
    _stale_lock(run)
    with pytest.raises(ConfigError, match="its process .* no longer runs.*refuses locks.*then remove"):
        runlock.RunLock(run).acquire()
    assert (run / rundir.LOCK_NAME).exists()


_CONTEND = """
import json, pathlib, sys
from xmoe_jax.config import ConfigError
from xmoe_jax.train.runlock import RunLock
runs = [pathlib.Path(p) for p in sys.argv[1:]]
for run in runs:
    sys.stdin.readline()  # the go of this trial
    lock = RunLock(run)
    try:
        lock.acquire()
        print("held", flush=True)
    except ConfigError:
        print("refused", flush=True)
    sys.stdin.readline()  # every contender has answered
    lock.release()
    print("released", flush=True)
"""


def race(root: pathlib.Path, contenders: int, trials: int) -> dict[tuple[int, int], int]:
    """`contenders` processes call `RunLock.acquire()` on one stale lock at once, `trials` times;
    returns {(held, refused): trials}. Each process answers after every trial, so the held locks are
    all held at once when they are counted."""
    runs = []
    for trial in range(trials):
        run = root / f"n{contenders}-{trial}"
        run.mkdir()
        _stale_lock(run)
        runs.append(str(run))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTEND, *runs],
            cwd=REPO,
            env=os.environ,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(contenders)
    ]
    counts: dict[tuple[int, int], int] = {}
    try:
        for _ in range(trials):
            for p in procs:
                p.stdin.write("go\n")
            for p in procs:
                p.stdin.flush()
            answers = [p.stdout.readline().strip() for p in procs]
            key = (answers.count("held"), answers.count("refused"))
            counts[key] = counts.get(key, 0) + 1
            for p in procs:
                p.stdin.write("done\n")
                p.stdin.flush()
            assert [p.stdout.readline().strip() for p in procs] == ["released"] * contenders
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    return counts


def test_eight_trainers_on_a_stale_lock_one_holds(tmp_path):
    """Issue 38: eight processes on one stale lock, 40 trials (about a second). The rename takeover
    gave two holders in 6 of 1,000 such trials here; the slow test runs 1,000 of 3, 5 and 8."""
    assert race(tmp_path, 8, 40) == {(1, 7): 40}


@pytest.mark.slow
@pytest.mark.parametrize("contenders", [3, 5, 8])
def test_many_trainers_on_a_stale_lock_one_holds(tmp_path, contenders):
    """Issue 38: 3 to 8 processes on one stale lock, 1,000 trials each (3 to 9 s each)."""
    assert race(tmp_path, contenders, 1000) == {(1, contenders - 1): 1000}
