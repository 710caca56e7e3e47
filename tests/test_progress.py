"""Progress figures (issue 22): tokens/s leaves out the compiling first step and checkpoint saves,
the bar shows rate and ETA, and `xmoe-train` says what it is doing from its first second."""

from __future__ import annotations

import io
import time

from xmoe_jax.config import load_config
from xmoe_jax.params import count_params
from xmoe_jax.train.metrics import MetricsLogger, Throughput, format_eta
from xmoe_jax.units import format_count


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_throughput_leaves_out_compile_and_save_time():
    meter = Throughput(tokens_per_step=1000, flops_per_token=1.0, num_devices=1, peak=None)
    meter.tick()
    time.sleep(0.5)  # the first step: compilation
    meter.compiled()
    for _ in range(4):
        time.sleep(0.01)
        meter.tick()
    with meter.paused():
        time.sleep(0.5)  # a checkpoint save
    rate = meter.read()["tokens_per_s"]
    assert 4000 / 0.4 < rate < 4000 / 0.035, rate  # 4 steps in ~0.04 s (a busy host: < 0.4 s), not 1.04 s
    meter.tick()
    meter.compiled()  # a log point right at the compiling step: its rate, marked
    figures = meter.read()
    assert figures["includes_compile"] and figures["tokens_per_s"] > 0


def test_progress_bar_shows_rate_and_eta(tmp_path):
    stream = _Tty()
    logger = MetricsLogger(tmp_path, total_steps=200, stream=stream)
    logger.progress(50, steps_per_s=2.0, tokens_per_step=512)
    assert "step 50/200 | 2.00 steps/s | 1,024 tok/s | ETA 1:15" in stream.getvalue()
    logger.log({"step": 60, "loss": 1.0, "tokens_per_s": 10.0, "tflops_per_device": 0.0}, eta_s=3725)
    assert "ETA 1:02:05" in stream.getvalue()
    logger.close()
    assert format_eta(59.6) == "1:00" and format_eta(-1) == "0:00"


def test_start_up_summary_comes_before_anything_compiles(tmp_path, caplog):
    """The summary's lines (config, run dir, parameters; data) are logged before the checks that
    stop a bad start, so they reach the user within the first seconds."""
    from xmoe_jax.cli import train_main

    run = tmp_path / "taken"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")  # another run's: refused before compiling
    caplog.set_level("INFO", logger="xmoe_jax")
    assert train_main(["--set", f"train.run_dir={run}"]) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "xmoe_jax"]
    cache = [line for line in lines if line.startswith("compilation cache: ")]  # said once, early
    assert len(cache) == 1
    lines.remove(cache[0])
    counts = count_params(load_config(None).model)
    assert lines[0] == (
        f"config (built-in tiny defaults); run dir {run}; {format_count(counts.total)} parameters "
        f"({format_count(counts.active)} active per token)"
    )
    assert lines[0].endswith("K active per token)")
    assert lines[1] == "data: data.source=synthetic (generated, no files)"
