"""Multi-process liveness: when a process dies, the others stop within a bounded time, naming it.

Without this, a process whose peer died waits in a collective for ever (NCCL), or fails at once
and then hangs at exit in JAX's shutdown barrier until JAX's heartbeat timeout aborts it with a
C++ stack trace (gloo on CPU). So every process runs a daemon thread (`PeerWatch`) that, every
`period` seconds, publishes its state in the coordination service's key-value store
(`xmoe/peers/state/<id>`: a beat counter and `running`, `left` or `failed`, with a message).
Process 0 (which hosts the service) reads every state and publishes a verdict when
  1. a running peer's beat has not moved for `timeout` seconds (killed, crashed, node lost,
     frozen);
  2. a peer failed (its message is repeated) `3 * period` seconds ago;
  3. a peer left (its run ended, e.g. on an error only it saw) `timeout` seconds ago while
     process 0 still runs.
Every running process reads the verdict and ends with status `PEER_EXIT_CODE` after one line on
stderr naming the peer; a process that cannot reach the service for `timeout` seconds ends
likewise (process 0 died). Each process reads one key per period and process 0 reads all of them,
so the load on the service grows linearly with the process count. `timeout` is the launch plan's
`peer_timeout_s` (--peer-timeout, XMOE_PEER_TIMEOUT).

The CLI drives it: `watch(plan)` after start-up; `leave(code)` on an orderly end that every
process reaches together (success, bad input, non-finite loss, preemption), followed by
`distributed.shutdown()`; `fail(message)` on an unexpected error, which names the peers that
stopped answering and ends the process at once (JAX's shutdown barrier would wait for the dead).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import NoReturn

from xmoe_jax.launch import distributed

PEER_EXIT_CODE = 1
_STATES = "xmoe/peers/state/"
_VERDICT = "xmoe/peers/verdict/"


def _exit_now(lines: list[str], code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.write("".join(f"error: {line}\n" for line in lines))
    sys.stderr.flush()
    os._exit(code)


class PeerWatch:
    """The watch of one process (see the module docstring); inert for a single process."""

    def __init__(self, plan: distributed.LaunchPlan):
        self.pid, self.num = plan.process_id, plan.num_processes
        self.coordinator = plan.coordinator
        self.timeout = float(plan.peer_timeout_s)
        self.period = min(5.0, max(0.5, self.timeout / 10))
        self._client = distributed.coordination_client() if plan.is_multi_process else None
        self._state = {"beat": 0, "state": "running", "code": None, "message": ""}
        self._moved: dict[int, tuple[int, float]] = {}  # peer -> (beat, when it last moved); process 0
        self._noticed: dict[int, float] = {}  # peer -> when it was first seen failed or left; process 0
        self._contact = time.monotonic()  # last answer from the coordination service
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._client is not None:
            self._publish()
            self._thread = threading.Thread(target=self._run, name="xmoe-peer-watch", daemon=True)
            self._thread.start()

    # -- the thread

    def _publish(self) -> None:
        with self._lock:
            self._state["beat"] += 1
            value = json.dumps(self._state)
        self._client.key_value_set(f"{_STATES}{self.pid}", value, allow_overwrite=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            verdict = self._check(time.monotonic())
            if verdict is not None and not self._stop.is_set() and self._state["state"] == "running":
                self._set("left", PEER_EXIT_CODE, f"stopped because {verdict}")
                if self.pid == 0:
                    time.sleep(2 * self.period)  # the service ends with process 0: let the others read it
                _exit_now(
                    [
                        f"[process {self.pid}] stopping: {verdict}. See that process's log; the run "
                        "continues from its last checkpoint with --resume"
                    ],
                    PEER_EXIT_CODE,
                )

    def _states(self) -> dict[int, dict]:
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in self._client.key_value_dir_get(_STATES)}

    def _check(self, now: float) -> str | None:
        try:
            self._publish()
            if self.pid == 0:
                verdict = self._judge(self._states(), now)
                if verdict is not None:
                    self._client.key_value_set(f"{_VERDICT}0", verdict, allow_overwrite=True)
            else:
                found = self._client.key_value_dir_get(_VERDICT)
                verdict = found[0][1] if found else None
        except Exception as e:  # the service is down or unreachable
            if now - self._contact > self.timeout:
                return (
                    f"the coordination service of process 0 ({self.coordinator}) has not answered for "
                    f"{now - self._contact:.0f} s ({type(e).__name__}): process 0 died or is unreachable"
                )
            return None
        self._contact = now
        return verdict

    def _judge(self, peers: dict[int, dict], now: float) -> str | None:
        """Process 0's rules (module docstring) over every peer's published state."""
        running = self._state["state"] == "running"
        for pid in range(1, self.num):
            info = peers.get(pid, {"beat": -1, "state": "running"})
            beat, since = self._moved.get(pid, (None, now))
            if info["beat"] != beat:
                self._moved[pid] = (info["beat"], now)
                since = now
            name = f"process {pid} of {self.num}"
            if info["state"] == "running" and now - since > self.timeout:
                return f"{name} stopped responding {now - since:.0f} s ago (killed, crashed, frozen or its node failed)"
            if info["state"] in ("failed", "left") and running:
                waited = now - self._noticed.setdefault(pid, now)
                if info["state"] == "failed" and waited >= 3 * self.period:
                    return f"{name} failed: {info['message']}"
                if info["state"] == "left" and waited > self.timeout:
                    return (
                        f"{name} ended its run {waited:.0f} s ago (status {info['code']}"
                        f"{': ' + info['message'] if info['message'] else ''}) while the others still run"
                    )
        return None

    # -- the main thread

    def _set(self, state: str, code: int | None, message: str) -> None:
        with self._lock:
            self._state.update(state=state, code=code, message=message[:2000])
        try:
            self._publish()
        except Exception:  # the service is gone: the others learn it themselves
            pass

    def leave(self, code: int, message: str = "") -> None:
        """An orderly end that every process reaches: tell the others, stop watching."""
        if self._client is None:
            return
        self._set("left", code, message)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period)

    def fail(self, message: str) -> NoReturn:
        """An unexpected error: tell the others, name the peers that stopped answering, exit."""
        lines = [f"[process {self.pid}] {message}"]
        if self._client is not None:
            self._set("failed", None, message)
            try:  # which beats still move? read every state twice, a few periods apart
                before = self._states()
                time.sleep(4 * self.period)
                after = self._states()
                silent = [
                    p
                    for p in range(self.num)
                    if p != self.pid
                    and after.get(p, {}).get("state", "running") == "running"
                    and after.get(p, {}).get("beat") == before.get(p, {}).get("beat")
                ]
            except Exception:  # the service is gone with process 0
                silent = [0]
            if silent:
                lines.append(
                    f"[process {self.pid}] process(es) {', '.join(map(str, silent))} stopped responding "
                    "(killed, crashed or their node failed): the error above is likely a consequence"
                )
        _exit_now(lines, PEER_EXIT_CODE)


def watch(plan: distributed.LaunchPlan) -> PeerWatch:
    """Starts this process's watch (inert for one process)."""
    return PeerWatch(plan)
