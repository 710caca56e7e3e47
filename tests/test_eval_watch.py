"""Evaluation and watching a run, on one short training run with a real BPE tokenizer.

The run: Tiny Shakespeare (../shared/data; without it, documents made here), split into
documents, a byte-level BPE tokenizer trained by `tokenizers` in the test, 5% held out, eval every
20 steps. Checked: eval loss falls; eval is logged to metrics.jsonl and the terminal; neither the
train step nor the eval step compiles twice; `xmoe-eval` on the saved checkpoint reproduces the
in-run number.
"""

from __future__ import annotations

import io
import json
import logging
import math
import pathlib

import jax
import pytest
from data_helpers import SHARED_TEXT, documents, train_bpe, write_jsonl

from xmoe_jax.cli import eval_main
from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.train.evaluate import evaluate_checkpoint
from xmoe_jax.train.loop import train
from xmoe_jax.train.metrics import MetricsLogger

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 20


def _corpus_documents() -> list[str]:
    if SHARED_TEXT.is_file():  # speeches, split on blank lines
        return [p for p in SHARED_TEXT.read_text().split("\n\n") if p.strip()]
    return documents(3000)


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


def test_xmoe_eval_needs_eval_data(run, tmp_path) -> None:
    with pytest.raises(ConfigError, match="holds no config.yaml"):
        evaluate_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="has no eval data"):
        evaluate_checkpoint(run["run_dir"], overrides=["eval.holdout=0", "eval.every=0"])
