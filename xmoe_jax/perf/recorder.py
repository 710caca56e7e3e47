"""One results recorder for the kernel benchmarks in scripts/ (bench_gmm, bench_gmm_ws, bench_gmm_push,
bench_fp8, bench_gather_gmm): every row is printed as it is measured and the whole file is rewritten at
once, so a run cut short (a device call's time limit, an OOM) keeps what it measured.

File format: {**meta, "results": [row, ...]}; meta names the device, JAX version and config
(`timing.environment()` plus the script's own keys).
"""

from __future__ import annotations

import json

from xmoe_jax.perf.timing import time_fn


class Recorder:
    def __init__(self, path, meta: dict | None = None):
        self.path, self.meta, self.rows = path, dict(meta or {}), []

    def add(self, **row):
        """Record one row: printed as key=value (not `trace`, a profile's path list), then saved."""
        self.rows.append(row)
        print(
            " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "trace"
            ),
            flush=True,
        )
        if self.path:
            with open(self.path, "w") as f:
                json.dump({**self.meta, "results": self.rows}, f, indent=1)

    def measure(self, fn, args, flops, iters=10, **key):
        """Time fn(*args) (median of `iters`) as a row with ms and TFLOP/s; a failure is a row too."""
        try:
            seconds = time_fn(fn, *args, warmup=2, iters=iters)
            self.add(**key, ms=seconds * 1e3, tflops=flops / seconds / 1e12)
            return seconds
        except Exception as e:  # noqa: BLE001  (a failure is a result)
            self.add(**key, error=f"{type(e).__name__}: {str(e)[:400]}")
            return None
