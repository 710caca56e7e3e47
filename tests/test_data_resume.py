"""Resume stays exact with the new sources: a run of 4 steps equals 2 + resume + 2, bitwise, on a
mixture of every kind of dataset (jsonl, parquet, txt files, a datasets directory, xmoe-tokenize
shards, Megatron .bin/.idx) with held-out evaluation every 2 steps."""

from __future__ import annotations

import json
import pathlib

import pytest
from data_helpers import documents, write_corpus

from xmoe_jax.config import load_config
from xmoe_jax.train.loop import train

TINY = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@pytest.mark.slow  # ~32 s; the mixture's resume alone: test_data_sources.py
def test_resume_is_exact_on_a_mixture_of_every_source(tmp_path) -> None:
    paths = write_corpus(tmp_path / "corpus", documents(400, seed=7))
    extra = {"parquet": {"text_field": "body"}}
    kinds = ["jsonl", "parquet", "txt", "hf", "arrayrecord", "megatron"]
    mixture = [{"path": paths[k], "weight": 1.0 + i, **extra.get(k, {})} for i, k in enumerate(kinds)]
    common = [
        f"data.mixture={json.dumps(mixture)}",
        "eval.holdout=0.05",
        "eval.every=2",
        "eval.steps=2",
        "train.log_every=1",
        "checkpoint.every=2",
    ]

    def cfg(run: str, steps: int):
        return load_config(TINY, [*common, f"train.run_dir={tmp_path / run}", f"train.steps={steps}"])

    full = train(cfg("full", 4))
    first = train(cfg("split", 2))
    second = train(cfg("split", 4), resume=True)
    assert sorted(second.losses) == [3, 4]
    assert {**first.losses, **second.losses} == full.losses  # bitwise: same batches, same state
    assert first.evals + second.evals == full.evals
    assert [e["step"] for e in full.evals] == [2, 4]
