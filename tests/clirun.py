"""Runs `python -m xmoe_jax.cli` in subprocesses for the reliability tests: environment, start,
wait for output or files, signal, and a bounded wait for the exit status.

The child imports the package from the repository root (cwd) and inherits PYTHONPATH, so it runs
the code under test from a worktree or a clean clone alike. A compilation cache shared by the
test session keeps each start to a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
# a short run of the tiny model: every step logged, asynchronous checkpoints every 4 steps
STEPS = 12
SHORT = ["train.log_every=1", "train.seq_len=32", "checkpoint.every=4", "checkpoint.keep=3"]


@contextlib.contextmanager
def compile_cache(cache_dir: pathlib.Path):
    """Points this process's JAX at the compilation cache the subprocesses use (restored after).
    Use one directory per test session (`session_cache_dir`): the tests share their programs."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {n: getattr(jax.config, n) for n in names}
    jax.config.update(names[0], str(cache_dir))
    jax.config.update(names[1], 0)
    compilation_cache.reset_cache()
    try:
        yield cache_dir
    finally:
        for n, v in before.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()


def session_cache_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.getbasetemp() / "jax-compilation-cache"
    path.mkdir(exist_ok=True)
    return path


def env(devices: int, cache_dir: pathlib.Path, **extra: str) -> dict:
    drop = ("SLURM_", "XMOE_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS", "XLA_FLAGS")
    base = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {
        **base,
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        # no GPU preset flags: XLA_FLAGS then equals this process's, and so do the cache keys
        "XMOE_RAGGED_A2A": "default",
        **extra,
    }


def tiny_config(run_dir: pathlib.Path, *overrides: str):
    """The run of `args`, as a config for `train()` in this process."""
    from xmoe_jax.config import load_config

    return load_config(TINY, [f"train.run_dir={run_dir}", *SHORT, f"train.steps={STEPS}", *overrides])


def args(run_dir: pathlib.Path, *overrides: str) -> list[str]:
    sets = [f"train.run_dir={run_dir}", *SHORT, f"train.steps={STEPS}", *overrides]
    return ["--config", str(TINY), *[x for s in sets for x in ("--set", s)]]


class Cli:
    """One `xmoe-train` process writing its output to `<logs>/<name>.out` / `.err`."""

    def __init__(self, argv: list[str], environ: dict, logs: pathlib.Path, name: str):
        self.out_path, self.err_path = logs / f"{name}.out", logs / f"{name}.err"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xmoe_jax.cli", *argv],
            env=environ,
            cwd=REPO,
            stdout=self.out_path.open("w"),
            stderr=self.err_path.open("w"),
        )

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.running():
            self.proc.send_signal(sig)

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> None:
        """Polls `ready` until it holds; fails (killing the process) if the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            if not self.running() or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(
                    f"{what}: not reached (exit {self.proc.poll()}) within {timeout} s\n{self.err[-3000:]}"
                )
            time.sleep(poll)

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        self.wait_until(lambda: f"step {step:>6}/" in self.out, timeout, f"step {step}")

    def wait(self, timeout: float = 240) -> int:
        """The exit status; kills the process and fails if it runs past `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {timeout} s\n{self.err[-3000:]}") from None


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl, asserting one record per step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps not one per step: {steps}"
    return {r["step"]: r["loss"] for r in records}
