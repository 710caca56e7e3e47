"""Throughput accounting and the metrics sinks (terminal/plain lines, metrics.jsonl, TensorBoard).

Model FLOPs per token (training, forward + backward = 3x forward):
    6 * (active matmul parameters) + 6 * (L + mtp_depth) * S * H * (Dqk + Dv)
where active matmul parameters = attention + dense MLPs + router + top_k routed
experts + shared experts + LM head (the input embedding is a lookup, norms are not
matmuls), plus per multi-token prediction module its projection, block and the shared
head; L layers, S sequence length, H heads of Dqk query/key and Dv value dims (MHA: both
Dh, so 12 * L * S * H * Dh; MLA: N + R and U); the attention term counts QK^T and AV
without a causal discount (the PaLM convention). Only active
experts count, so the figure does not grow with the number of experts.
MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from xmoe_jax import storage
from xmoe_jax.config import ModelConfig
from xmoe_jax.params import count_params
from xmoe_jax.train.rundir import RunDir

RESUME_FIX = (
    "free space, raise the quota or the file-size limit (ulimit -f), then run the same command with "
    "--resume (the checkpoints saved are intact)"
)
# peak dense bf16 TFLOP/s per device (one GCD for MI250X), by jax device_kind prefix
PEAK_TFLOPS = {
    "NVIDIA H100": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA B200": 2250.0,
    "NVIDIA A100": 312.0,
    "AMD Instinct MI250X": 191.5,
    "AMD Instinct MI300X": 1307.0,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    counts = count_params(cfg)
    matmul_active = counts.active - counts.breakdown["embed"] - counts.breakdown["norms"]
    per_layer = 6 * seq_len * cfg.num_heads * (cfg.head_size + cfg.value_head_size)
    return 6.0 * (matmul_active + counts.mtp_active) + (cfg.num_layers + cfg.mtp_depth) * per_layer


def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
    if override is not None:
        return override
    for prefix, value in PEAK_TFLOPS.items():
        if device_kind.startswith(prefix):
            return value
    return None


def _imbalance(load_LX) -> list[float]:
    load = np.asarray(load_LX, dtype=np.float64)
    return [round(float(v), 3) for v in load.max(-1) / np.maximum(load.mean(-1), 1e-9)]


def expert_load(tokens_per_expert_LE) -> list[list[float]]:
    """Per MoE layer, each expert's routed copies / the layer's mean, to 2 decimals (1.0 is
    balanced; a collapsed router shows one expert near E and the rest near 0): compact enough
    for every log line of metrics.jsonl, and what `xmoe-plot` draws as a heat map."""
    load_LE = np.asarray(tokens_per_expert_LE, dtype=np.float64)
    rel_LE = load_LE / np.maximum(load_LE.mean(-1, keepdims=True), 1e-9)
    return [[round(float(v), 2) for v in row] for row in rel_LE]


def expert_stats(tokens_per_expert_LE, drop_rate_L, recv_rows_LP=None) -> dict:
    """Per-layer load imbalance (max/mean routed copies), drop rate, per-expert load and, for
    pft, the imbalance of rows received per device (max/mean)."""
    out = {
        "expert_imbalance": _imbalance(tokens_per_expert_LE),
        "drop_rate": [round(float(v), 4) for v in np.asarray(drop_rate_L)],
        "expert_load": expert_load(tokens_per_expert_LE),
    }
    if recv_rows_LP is not None:
        out["recv_imbalance"] = _imbalance(recv_rows_LP)
    return out


def exchange_bound_ratio(rows_PP) -> float:
    """How much faster an exact exchange could be than a dense one on this routing: a dense
    all-to-all moves (P-1) x the largest off-diagonal pair per device, an exact one is bound by
    the busiest device's off-diagonal sends or receives. R = (P-1) x max pair / max(row or column
    sum), both off the diagonal (rows a device keeps never travel); 1.0 is uniform routing (no
    prize), P-1 is one hot pair. 1.0 when nothing crosses devices."""
    rows = np.asarray(rows_PP, np.float64)
    off = rows * (1 - np.eye(rows.shape[0]))
    busiest = max(off.sum(0).max(), off.sum(1).max())
    return 1.0 if busiest == 0 else float((rows.shape[0] - 1) * off.max() / busiest)


def exchange_stats(metrics: dict, ladder) -> dict:
    """Per-layer wire accounting (bytes per device, dispatch + combine: what the transport moved and
    what the routing needed), the routed rows between expert-axis ranks ([P, P] per layer, summed over
    the data shards and micro-batches) with their `exchange_bound_ratio`, and the adaptive buffers' state."""
    wire_L = np.asarray(metrics["wire_bytes"], np.float64).mean(-1)
    routed_L = np.asarray(metrics["routed_bytes"], np.float64).mean(-1)
    rows_LPP = np.asarray(metrics["exchange_rows"], np.int64)
    return {
        "wire_bytes": [round(float(v)) for v in wire_L],
        "routed_bytes": [round(float(v)) for v in routed_L],
        "exchange_rows": rows_LPP.tolist(),
        "exchange_bound_ratio": [round(exchange_bound_ratio(r), 3) for r in rows_LPP],
        "peak_ratio": round(float(metrics["peak_ratio"]), 3),
        "buffer_factor": ladder.factor,
        "buffer_changes": ladder.changes,
    }


def format_eta(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    s = max(int(round(seconds)), 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def strict_json(value):
    """`value` with every non-finite float (NaN, inf: a skipped step's loss) as None, so
    metrics.jsonl is strict JSON (null), which every JSON reader accepts; bare NaN is not JSON."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes metrics.jsonl (training records, and evaluation records holding `eval_loss`), shows
    progress (a live line on a terminal, plain lines when piped) and, with `tensorboard`, writes
    the same records as TensorBoard summaries under <run_dir>/tensorboard."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool = True, stream=None, tensorboard=False):
        self.enabled = enabled
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.path = RunDir(run_dir).metrics
        self._file = self.path.open("a") if enabled else None
        self._tensorboard = None
        if enabled and tensorboard:
            from xmoe_jax.train.tensorboard import TensorBoardWriter

            self._tensorboard = TensorBoardWriter(RunDir(run_dir).tensorboard)

    def log(self, record: dict, eta_s: float | None = None) -> None:
        if not self.enabled:
            return
        with storage.writing(self.path, RESUME_FIX):  # a torn last line is trimmed on resume
            self._file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)
        self.stream.write(self._line(record, eta_s) + "\n")
        self.stream.flush()

    def progress(self, step: int, steps_per_s: float | None = None, tokens_per_step: int = 0) -> None:
        """Between log points on a terminal: a bar that rewrites itself, with the rate and the ETA
        (from the current throughput window: compilation and saves left out)."""
        if not (self.enabled and self.tty):
            return
        width = 30
        done = int(width * step / max(self.total, 1))
        rate = ""
        if steps_per_s:
            rate = f" | {steps_per_s * tokens_per_step:,.0f} tok/s" if tokens_per_step else ""
            rate = f" | {steps_per_s:.2f} steps/s{rate} | ETA {format_eta((self.total - step) / steps_per_s)}"
        self.stream.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{self.total}{rate}\x1b[K")
        self.stream.flush()
        if step == self.total:
            self.stream.write("\r\x1b[K")

    def _line(self, r: dict, eta_s: float | None = None) -> str:
        prefix = "\r\x1b[K" if self.tty else ""
        if "eval_loss" in r:
            return (
                prefix
                + f"step {r['step']:>6}/{self.total} | eval loss {r['eval_loss']:.4f} | ppl {r['eval_ppl']:.2f}"
            )
        parts = [f"step {r['step']:>6}/{self.total}", f"loss {r['loss']:.4f}"]
        parts.append(
            f"tok/s {r['tokens_per_s']:,.0f}" + (" (incl. compile)" if r.get("includes_compile") else "")
        )
        parts.append(f"TFLOP/s/dev {r['tflops_per_device']:.2f}")
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if "expert_imbalance" in r:
            parts.append(f"imb {max(r['expert_imbalance']):.2f}")
            parts.append(f"drop {max(r['drop_rate']):.3f}")
        if eta_s is not None:
            parts.append(f"ETA {format_eta(eta_s)}")
        return prefix + " | ".join(parts)

    def close(self) -> None:
        if self._file:
            with contextlib.suppress(OSError):  # a failed write was reported when it failed
                self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


class Throughput:
    """Wall time between log points -> tokens/s, model TFLOP/s per device, MFU.

    Time that is not training is left out of the figures: the first step of a start or resume,
    which compiles the step (`compiled`), and checkpoint saves (`paused`); evaluation restarts the
    window (`reset`). A window that holds nothing but the compiling step (a log point right at the
    first step) reports that step's rate, marked `includes_compile`.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, num_devices: int, peak: float | None):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.peak = peak
        self._compile_window: tuple[int, float] | None = None
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.steps = 0
        self.excluded = 0.0

    def tick(self) -> None:
        self.steps += 1

    def _elapsed(self) -> float:
        return max(time.perf_counter() - self.t0 - self.excluded, 1e-9)

    def compiled(self) -> None:
        """The steps ticked so far compiled the step function: the window starts after them."""
        self._compile_window = (self.steps, self._elapsed())
        self.reset()

    @contextlib.contextmanager
    def paused(self):
        """Time inside (a checkpoint save) is not training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start

    def steps_per_s(self) -> float | None:
        """The current window's rate (for the progress bar and ETA); None before its first step."""
        return self.steps / self._elapsed() if self.steps else None

    def read(self) -> dict:
        steps, elapsed, compile_only = self.steps, self._elapsed(), False
        if steps == 0 and self._compile_window is not None:
            (steps, elapsed), compile_only = self._compile_window, True
        self._compile_window = None
        tokens_per_s = steps * self.tokens_per_step / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.num_devices / 1e12
        self.reset()
        out = {
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak if self.peak else None,
        }
        if compile_only:
            out["includes_compile"] = True
        return out
