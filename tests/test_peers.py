"""Two CPU processes (one device each) joined by jax.distributed (gloo), the real CLI: a signal to
one process stops both after the same step with status 75, the resume finishes, and both runs
leave jax.distributed without coordination errors; a process killed (SIGKILL) or frozen (SIGSTOP)
makes the other stop within a bounded time with a message naming it (`xmoe_jax.launch.peers`). Resume
exactness is shown in one process (test_preemption.py) and across process counts
(test_multihost.py)."""

from __future__ import annotations

import re
import signal
import time

import portpicker
import pytest
from clirun import Cli, args, env, losses

from xmoe_jax.train.preemption import PREEMPTED_EXIT_CODE

MESH = ["mesh.data=2", "mesh.expert=1"]  # one device per process: what matters here is the processes
PEER_TIMEOUT_S = 6
NOISE = ("WatchTasksAsync", "Connection refused", "heartbeat", "Terminating process", "Check failure")


def _pair(tmp_path, name: str, cache, run, *overrides: str, resume: bool = False) -> list[Cli]:
    port = portpicker.pick_unused_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--init-timeout", "120"]
    flags += ["--peer-timeout", str(PEER_TIMEOUT_S)] + (["--resume"] if resume else [])
    argv = args(run, *MESH, *overrides) + flags
    return [Cli([*argv, "--process-id", str(i)], env(1, cache), tmp_path, f"{name}.{i}") for i in range(2)]


def _clean(cli: Cli) -> None:
    noise = [n for n in NOISE if n in cli.err]
    assert not noise, f"{cli.err_path.name}: {noise}\n{cli.err[-3000:]}"


@pytest.mark.slow  # ~32 s: two processes compile and train
def test_signal_to_one_process_stops_both_at_one_step_then_resume_finishes_cleanly(tmp_path, compile_cache):
    run = tmp_path / "run"
    first = _pair(tmp_path, "first", compile_cache, run)
    first[0].wait_for_step(4)
    first[1].signal(signal.SIGTERM)  # only process 1 hears it
    assert [p.wait(120) for p in first] == [PREEMPTED_EXIT_CODE] * 2, first[0].err + first[1].err
    stopped = re.search(
        r"stopped by a peer's signal after step (\d+): checkpoint step \1 saved", first[0].err
    )
    assert stopped, first[0].err
    step = int(stopped.group(1))
    data = sorted(p.name for p in (run / "checkpoints" / str(step) / "data").glob("process_*.json"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]  # both saved that same step
    second = _pair(tmp_path, "second", compile_cache, run, resume=True)
    assert [p.wait(120) for p in second] == [0, 0], second[0].err + second[1].err
    assert f"at step {step}" in second[0].err and "done:" in second[0].out
    for p in first + second:
        _clean(p)
    assert sorted(losses(run)) == list(range(1, 13))  # every step once (exactness: test_preemption.py)


@pytest.mark.slow  # ~54 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
@pytest.mark.parametrize("how", ["killed", pytest.param("frozen", marks=pytest.mark.slow)])
def test_a_dead_process_makes_the_other_stop_in_bounded_time_naming_it(tmp_path, compile_cache, how):
    run = tmp_path / "run"
    pair = _pair(tmp_path, how, compile_cache, run, "checkpoint.enabled=false")
    try:
        pair[0].wait_for_step(3)
        pair[1].signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        rc = pair[0].wait(PEER_TIMEOUT_S + 60)
        elapsed = time.monotonic() - t0
    finally:
        pair[1].signal(signal.SIGKILL)
        pair[1].wait(30)
    assert rc == 1, pair[0].err
    assert elapsed < PEER_TIMEOUT_S + 30, elapsed  # bounded: the peer timeout plus a few periods
    if how == "killed":  # gloo fails at once; the watch names the silent peer
        assert "process(es) 1 stopped responding" in pair[0].err, pair[0].err
    else:  # the collective hangs; the watch ends it after the peer timeout
        assert "stopping: process 1 of 2 stopped responding" in pair[0].err, pair[0].err
    assert "--resume" in pair[0].err or how == "killed"
