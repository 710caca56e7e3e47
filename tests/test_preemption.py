"""Stop signals: the trainer finishes the step in flight, saves it, exits with status 75, and the
resumed run's losses equal an uninterrupted run's, bitwise (CPU, 8 fake devices, the tiny model).

One uninterrupted run in this process is the reference; the interrupted runs are the real CLI in
subprocesses (SIGTERM, twice) and `train()` in this process (SIGINT from a helper thread). Before
the first step (compiling) a stop signal ends the CLI at once, and the same command starts again
(issue 37 3.6).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from clirun import REPO, STEPS, Cli, args, env, losses, tiny_config

from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.train.loop import train
from xmoe_jax.train.preemption import PREEMPTED_EXIT_CODE, Preempted


@pytest.mark.slow  # ~28 s: a CLI subprocess; the in-process SIGINT test below stays in the default run
def test_sigterm_saves_the_step_in_flight_exits_75_and_resumes_exactly(
    tmp_path, tiny_reference, compile_cache
):
    run = tmp_path / "run"
    first = Cli(args(run), env(8, compile_cache), tmp_path, "first")
    first.wait_for_step(5)
    first.signal(signal.SIGTERM)
    first.wait_until(lambda: "received SIGTERM:" in first.err, 60, "the first signal handled", poll=0.005)
    first.signal(signal.SIGTERM)  # a second signal, during the step or the save, changes nothing
    assert first.wait(120) == PREEMPTED_EXIT_CODE, first.err
    stopped = re.search(
        r"stopped by SIGTERM after step (\d+): checkpoint step (\d+) saved in (\S+);", first.err
    )
    assert stopped and stopped.group(1) == stopped.group(2), first.err
    step = int(stopped.group(1))
    assert 5 <= step < STEPS and "--resume" in first.err and "received SIGTERM again" in first.err
    assert (run / "checkpoints" / str(step)).is_dir()
    assert "done:" not in first.out

    second = Cli([*args(run), "--resume"], env(8, compile_cache), tmp_path, "second")
    assert second.wait(120) == 0, second.err
    assert f"resumed from {run / 'checkpoints'} at step {step}" in second.err
    assert losses(run) == tiny_reference[1]  # every step once, bitwise equal


@pytest.fixture
def sigint_handler():
    """A known SIGINT handler for the test, whatever pytest started with (started in the background,
    pytest inherits SIGINT ignored); the original one is put back afterwards."""

    def found(signum, frame):  # stands for whatever handler the caller had
        raise KeyboardInterrupt

    original = signal.signal(signal.SIGINT, found)
    try:
        yield found
    finally:
        signal.signal(signal.SIGINT, original)


@pytest.mark.slow  # ~64 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_sigint_in_process_raises_preempted_and_resumes_exactly(tmp_path, tiny_reference, sigint_handler):
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"

    def interrupt_after_step_three() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    helper = threading.Thread(target=interrupt_after_step_three, daemon=True)
    helper.start()
    with pytest.raises(Preempted) as stopped:
        train(tiny_config(run))
    helper.join()
    step = stopped.value.step
    assert stopped.value.signal_name == "SIGINT" and stopped.value.saved_step == step and 3 <= step < STEPS
    assert signal.getsignal(signal.SIGINT) is sigint_handler  # the handler train() found, restored
    resumed = train(tiny_config(run), resume=True)
    assert sorted(resumed.losses) == list(range(step + 1, STEPS + 1))
    assert losses(run) == tiny_reference[1]


def test_stop_signals_are_validated():
    with pytest.raises(ConfigError, match="train.stop_signals: SIGKILL"):
        load_config(None, ["train.stop_signals=TERM,KILL"])
    assert load_config(None, ["train.stop_signals=''"]).train.stop_signals == ""


def test_slurm_wrapper_passes_sigterm_on_requeues_on_75_and_resumes(tmp_path):
    """scripts/slurm_requeue.sh with a stand-in srun step (bash) and scontrol (records its call)."""
    (tmp_path / "scontrol").write_text(f'#!/bin/bash\necho "$*" > {tmp_path}/scontrol.log\n')
    (tmp_path / "scontrol").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(
        "set -euo pipefail\n"
        f"source {REPO / 'scripts' / 'slurm_requeue.sh'}\n"
        'CMD=(bash -c \'echo "$*" > args.log; trap "exit 75" TERM; sleep 60 & wait\' step)\n'
        "xmoe_resume_flag CMD\n"
        'xmoe_run_and_requeue env -- "${CMD[@]}"\n'
    )
    environ = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "42"}
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env={**environ, "SLURM_RESTART_COUNT": "1"})
    deadline = time.monotonic() + 30
    while not (tmp_path / "args.log").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the shell's traps are set before srun starts
    job.send_signal(signal.SIGTERM)  # scancel / --signal=B:TERM reach the batch shell
    assert job.wait(timeout=30) == PREEMPTED_EXIT_CODE
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "42"]
    # a requeued job resumes; its first run may have died before it wrote anything
    assert (tmp_path / "args.log").read_text().split() == ["--resume-or-start"]


LATE_SIGNALS = """
import os, signal, sys
from xmoe_jax.train import preemption
if sys.argv[1] == "cli":
    preemption.ignore_after_stop()
try:
    with preemption.StopSignals("SIGUSR1", None) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.stop_now(1)
        raise stop.stop(1, None, {}, None, None)
except preemption.Preempted:
    for _ in range(50):  # a storm after the stop: before, the default action ended the process (143)
        os.kill(os.getpid(), signal.SIGUSR1)
    sys.exit(75)
"""


@pytest.mark.parametrize("mode", ["cli", "library"])
def test_stop_signals_after_the_stop_began_are_ignored(mode):
    """Issue 23 2.9: a SIGTERM storm after the stop message killed the process (143) and left
    `run.lock` behind. With `ignore_after_stop()` (the CLI) the stop signals stay ignored from then
    on; a library caller gets the previous handlers back (here: the default action)."""
    done = subprocess.run(
        [sys.executable, "-c", LATE_SIGNALS, mode], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    if mode == "cli":
        assert done.returncode == PREEMPTED_EXIT_CODE, done.stderr
        assert done.stderr.count("received SIGUSR1") == 1  # no storm in the log either
    else:
        assert done.returncode == -signal.SIGUSR1


@pytest.mark.slow  # ~25 s: a CLI subprocess under a storm of SIGTERMs
def test_a_sigterm_storm_still_ends_in_75_with_the_lock_removed(tmp_path, compile_cache):
    run = tmp_path / "run"
    cli = Cli(args(run), env(8, compile_cache), tmp_path, "storm")
    cli.wait_for_step(3)
    sent = 0
    while cli.running() and sent < 5000:
        cli.signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.002)
    assert cli.wait(120) == PREEMPTED_EXIT_CODE, cli.err
    assert not (run / "run.lock").exists() and sent > 10
    assert cli.err.count("received SIGTERM again") == 1


BEFORE_FIRST_STEP = """
import pathlib, signal, sys, threading, os, time
from xmoe_jax.train import preemption
preemption.ignore_after_stop()  # as the CLI: the process exits on a stop
tidied = pathlib.Path(sys.argv[1])
with preemption.StopSignals("SIGINT,SIGTERM", None, before_first_step=tidied.unlink):
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    time.sleep(60)  # stands for XLA's compiler, which returns only when done
"""


def test_a_stop_signal_before_the_first_step_ends_the_cli_at_once():
    """Issue 37 3.6: Ctrl-C while the first step compiled was held until it had run (27.6 s on a CPU,
    minutes on a GPU), then checkpoint 1 was saved and the same command refused the run directory.
    Now: the loop's cleanup, one line and status 75 within moments."""
    import tempfile

    with tempfile.NamedTemporaryFile(delete=False) as f:
        tidied = f.name
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", BEFORE_FIRST_STEP, tidied],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == PREEMPTED_EXIT_CODE and time.monotonic() - started < 20, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "stopped by SIGINT before the first step: nothing new saved" in lines[0], lines
    assert "run the same command to start again (exit status 75)" in lines[0]
    assert not os.path.exists(tidied)  # the loop's cleanup ran


@pytest.mark.slow  # ~60 s: a CLI run interrupted while it compiles, then the same command in full
def test_ctrl_c_while_compiling_stops_at_once_and_the_same_command_starts_again(tmp_path, compile_cache):
    run = tmp_path / "run"
    fresh = tmp_path / "cache"  # nothing compiled yet: the first step compiles for seconds
    fresh.mkdir()
    first = Cli(args(run), env(8, fresh, XMOE_COMPILE_CACHE=str(fresh)), tmp_path, "first")
    first.wait_until(lambda: "compiling the train step" in first.err, 240, "the compile started")
    time.sleep(0.5)
    sent = time.monotonic()
    first.signal(signal.SIGINT)
    assert first.wait(60) == PREEMPTED_EXIT_CODE, first.err
    assert time.monotonic() - sent < 10, "not at once"
    after = first.err.split("compiling the train step")[1].strip().splitlines()[1:]
    assert len(after) == 1 and "stopped by SIGINT before the first step" in after[0], first.err
    assert not (run / "run.lock").exists() and not (run / "metrics.jsonl").exists()
    assert not list((run / "checkpoints").iterdir())
    second = Cli(args(run), env(8, compile_cache), tmp_path, "second")  # the same command
    assert second.wait(240) == 0, second.err
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
