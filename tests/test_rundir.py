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
from xmoe_jax.train import rundir
from xmoe_jax.train.loop import train

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
HOLD = (
    "import sys, time, pathlib; from xmoe_jax.train.rundir import RunLock; "
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
    lock = rundir.claim(run, is_main=True)  # the dead holder's lock is stale
    assert f"its process {proc.pid} no longer runs" in caplog.text
    assert json.loads((run / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / "run.lock").exists()


def test_lock_of_a_reused_pid_or_an_earlier_slurm_run_is_stale(tmp_path, monkeypatch):
    me = rundir._me()
    assert (
        rundir._stale_reason({**me, "start_time": "1"}, 0)
        == f"pid {me['pid']} now belongs to another process"
    )
    assert rundir._stale_reason(me, 0) is None  # this very process: live
    other = {**me, "host": "elsewhere", "slurm_job": "77", "slurm_restart": 0}
    assert rundir._stale_reason(other, 10) is None
    assert "not refreshed" in rundir._stale_reason(other, rundir.STALE_AFTER_S + 1)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert "earlier run of this SLURM job" in rundir._stale_reason(other, 10)


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
    rundir.trim_metrics(tmp_path, 4)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:4])
    discarded = (tmp_path / rundir.DISCARDED_METRICS).read_text().splitlines()
    assert discarded[:2] == [line.strip() for line in lines[4:]] and discarded[2] == '{"step": 7, "lo'
    rundir.trim_metrics(tmp_path, 4)  # nothing more to move
    assert len((tmp_path / rundir.DISCARDED_METRICS).read_text().splitlines()) == 3
