"""Timing helpers shared by the scripts in scripts/ (never used by tests for speed claims).

`time_fn` warms up, synchronises, and reports the median of repeated runs;
`dense_matmul_tflops` measures the device's dense matmul ceiling in the same run,
the baseline every benchmark prints its ratio against.
"""

from __future__ import annotations

import platform
import statistics
import time
from datetime import UTC, datetime

import jax
import jax.numpy as jnp
import numpy as np


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64: a benchmark's check of a result against its reference."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def time_fn(fn, *args, warmup: int = 2, iters: int = 10) -> float:
    """Median wall time in seconds of `fn(*args)` (blocked until ready)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_matmul_tflops(n: int = 8192, dtype=jnp.bfloat16, iters: int = 10) -> float:
    """TFLOP/s of an n x n x n matmul on random inputs (not zeros)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    mm = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / time_fn(mm, a, b, iters=iters) / 1e12


def environment() -> dict:
    """What a results file records about where it was measured."""
    dev = jax.devices()[0]
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev.device_kind,
        "num_devices": jax.device_count(),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
