"""Evaluation and watching a run, on one short training run with a real BPE tokenizer.

The run: Tiny Shakespeare (the repository's data/tinyshakespeare.txt), split into
documents, a byte-level BPE tokenizer trained by `tokenizers` in the test, 5% held out, eval every
20 steps, a profile of steps 5-6. Checked: eval loss falls; eval is logged to metrics.jsonl and
the terminal; neither the train step nor the eval step compiles twice; `xmoe-eval` on the saved
checkpoint reproduces the in-run number; TensorBoard event files hold the metrics; metrics.jsonl
holds the per-expert load; the profile trace exists; `xmoe-plot` writes its PNGs.
"""

from __future__ import annotations

import io
import json
import logging
import math
import pathlib
import struct

import jax
import pytest
from data_helpers import SHARED_TEXT, train_bpe, write_jsonl

from xmoe_jax.cli import eval_main, plot_main
from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.train.evaluate import evaluate_checkpoint
from xmoe_jax.train.loop import train
from xmoe_jax.train.metrics import MetricsLogger

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 20


def _corpus_documents() -> list[str]:
    return [p for p in SHARED_TEXT.read_text().split("\n\n") if p.strip()]  # speeches


class _CompileLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe_run")
    docs = _corpus_documents()
    corpus = write_jsonl(root / "corpus.jsonl", docs)
    tokenizer = train_bpe(docs, root / "tokenizer.json", vocab_size=512)
    overrides = [
        f"train.run_dir={root / 'run'}",
        f"data.path={corpus}",
        f"data.tokenizer={tokenizer}",
        "model.vocab_size=512",
        f"train.steps={STEPS}",
        "train.log_every=10",
        f"eval.every={EVERY}",
        "eval.steps=4",
        "eval.holdout=0.05",
        "checkpoint.every=30",
        "train.profile_steps=[5, 6]",
    ]
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    compiles = _CompileLog()
    logging.getLogger("jax").addHandler(compiles)
    jax.config.update("jax_log_compiles", True)
    try:
        result = train(cfg)
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(compiles)
    return {"root": root, "run_dir": root / "run", "result": result, "compiles": compiles.lines}


def test_eval_loss_falls(run) -> None:
    evals = run["result"].evals
    assert [e["step"] for e in evals] == [20, 40, 60]
    first, last = evals[0]["eval_loss"], evals[-1]["eval_loss"]
    assert last < first - 0.3 and last < math.log(512) - 1.0, (first, last)
    assert all(abs(e["eval_ppl"] - math.exp(e["eval_loss"])) < 1e-6 * e["eval_ppl"] for e in evals)


def test_eval_in_metrics_file(run) -> None:
    lines = [json.loads(x) for x in (run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [20, 40, 60]
    assert evals == run["result"].evals
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == list(range(10, STEPS + 1, 10))


def test_eval_line_on_the_terminal(tmp_path) -> None:
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, 60, stream=out)
    logger.log({"step": 20, "eval_loss": 2.0, "eval_ppl": math.exp(2.0), "eval_tokens": 10})
    logger.close()
    assert out.getvalue() == "step     20/60 | eval loss 2.0000 | ppl 7.39\n"


def test_neither_step_compiles_twice(run) -> None:
    compiled = [line.split(" with ")[0] for line in run["compiles"] if line.startswith("Compiling ")]
    assert compiled.count("Compiling jit(step)") == 1, compiled
    assert compiled.count("Compiling jit(eval_step)") == 1, compiled


def test_xmoe_eval_reproduces_the_in_run_eval(run, capsys) -> None:
    at_60 = run["result"].evals[-1]["eval_loss"]
    again = evaluate_checkpoint(run["run_dir"])
    assert again["step"] == STEPS and abs(again["eval_loss"] - at_60) < 1e-5 * at_60
    assert eval_main(["--run-dir", str(run["run_dir"]), "--step", "30"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 30: eval loss ") and "perplexity" in out
    before = (run["run_dir"] / "metrics.jsonl").read_text()
    assert eval_main(["--run-dir", str(run["run_dir"]), "--step", "7"]) == 2
    assert "no checkpoint for step 7" in capsys.readouterr().err
    assert (run["run_dir"] / "metrics.jsonl").read_text() == before  # xmoe-eval writes nothing


def test_xmoe_eval_on_other_data_uses_the_runs_tokenizer(run, capsys) -> None:
    """`--set eval.data.path=...` alone on a run that held out data (before: "alternatives; set one
    of them"), tokenized with the run's copy of its tokenizer (before: as bytes, loss about 10)."""
    assert (run["run_dir"] / "tokenizer" / "tokenizer.json").is_file()
    valid = write_jsonl(run["root"] / "valid.jsonl", _corpus_documents()[-100:])
    assert eval_main(["--run-dir", str(run["run_dir"]), "--set", f"eval.data.path={valid}"]) == 0
    loss = float(capsys.readouterr().out.split("eval loss ")[1].split(",")[0])
    assert loss < run["result"].evals[-1]["eval_loss"] + 1.0, loss


def test_xmoe_eval_needs_eval_data(run, tmp_path) -> None:
    with pytest.raises(ConfigError, match="holds no config.yaml"):
        evaluate_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="has no eval data"):
        evaluate_checkpoint(run["run_dir"], overrides=["eval.holdout=0", "eval.every=0"])


def _events(directory: pathlib.Path) -> dict[str, dict[int, object]]:
    """tag -> step -> value (a float, or the histogram proto) from TFRecord event files."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, object]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.histo if v.HasField("histo") else v.simple_value
    return out


def test_tensorboard_event_files(run) -> None:
    events = _events(run["run_dir"] / "tensorboard")
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/tflops_per_device"):
        assert sorted(events[tag]) == list(range(10, STEPS + 1, 10)), tag
    record = run["result"].records[-1]
    assert events["train/loss"][STEPS] == pytest.approx(record["loss"], rel=1e-6)
    assert events["eval/loss"][STEPS] == pytest.approx(run["result"].evals[-1]["eval_loss"], rel=1e-6)
    assert sorted(events["eval/perplexity"]) == [20, 40, 60]
    num_moe = len(record["expert_imbalance"])
    for layer in range(num_moe):
        assert events[f"moe/imbalance/layer_{layer}"][STEPS] == pytest.approx(
            record["expert_imbalance"][layer]
        )
        assert f"moe/drop_rate/layer_{layer}" in events
        histo = events[f"moe/expert_load/layer_{layer}"][STEPS]
        assert list(histo.bucket) == pytest.approx(record["expert_load"][layer])  # x = expert, height = load


def test_expert_load_in_metrics_file(run) -> None:
    for record in run["result"].records:
        load_LE = record["expert_load"]
        assert len(load_LE) == len(record["expert_imbalance"]) and all(len(row) == 8 for row in load_LE)
        for row, imbalance in zip(load_LE, record["expert_imbalance"], strict=True):
            assert sum(row) / len(row) == pytest.approx(1.0, abs=0.02)  # relative to the layer's mean
            assert max(row) == pytest.approx(imbalance, abs=0.01)


def test_profile_trace_written(run) -> None:
    traces = list((run["run_dir"] / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_xmoe_plot_writes_pngs(run, tmp_path, capsys) -> None:
    assert plot_main(["--run-dir", str(run["run_dir"])]) == 0
    written = capsys.readouterr().out.split()
    plots = run["run_dir"] / "plots"
    assert written == [str(plots / "loss.png"), str(plots / "expert_load.png")]
    for path in written:
        data = pathlib.Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert plot_main(["--run-dir", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err
