"""`xmoe-tokenize`: shards and summary, an interrupted job resumed equals an uninterrupted one,
another job's output is refused, and the trainer reads the result."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import documents, train_bpe, write_jsonl, write_parquet

from xmoe_jax.cli import tokenize_main
from xmoe_jax.config import DataConfig
from xmoe_jax.data import arrayrecord, load_tokenizer, make_input

DOCS = documents(400, seed=3)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenize")
    write_jsonl(root / "corpus" / "a.jsonl", DOCS[:150])
    write_parquet(root / "corpus" / "b.parquet", DOCS[150:300])
    write_jsonl(root / "corpus" / "c.jsonl", DOCS[300:])
    train_bpe(DOCS, root / "tokenizer.json")
    return root


def _args(root, out: str) -> list[str]:
    return [
        "--input",
        str(root / "corpus"),
        "--tokenizer",
        str(root / "tokenizer.json"),
        "--output",
        str(root / out),
        "--shard-tokens",
        "1000",
    ]


def _shard_bytes(directory) -> dict[str, bytes]:
    """Every file but the manifest, the tokenizer's copy included."""
    files = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "manifest.json"]
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def test_shards_summary_and_training_input(inputs, capsys) -> None:
    assert tokenize_main(_args(inputs, "whole")) == 0
    captured = capsys.readouterr()
    tok = load_tokenizer(str(inputs / "tokenizer.json"))
    expected = np.concatenate([np.asarray(ids + [tok.eos_id]) for ids in tok.encode_batch(DOCS)])
    manifest = json.loads((inputs / "whole" / "manifest.json").read_text())
    num_shards = len(manifest["shards"])
    shards = manifest["shards"]
    assert manifest["complete"] and num_shards > 1 and sum(s["tokens"] for s in shards) == len(expected)
    assert all(s["tokens"] >= 1000 for s in shards[:-1])  # a shard closes once it holds --shard-tokens
    assert f"done: 400 documents, {len(expected):,} tokens, {num_shards} shard(s)" in captured.out
    assert "shard 00000:" in captured.err  # progress, one line per shard
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == tok.vocab_size
    cfg = DataConfig(path=str(inputs / "whole"), shuffle=False)
    it = make_input(cfg, seq_len=32, batch_size=1, vocab_size=tok.vocab_size)
    windows = [next(it) for _ in range(20)]
    stream = np.concatenate([w["inputs"][0] for w in windows] + [windows[-1]["targets"][0, -1:]])
    np.testing.assert_array_equal(stream, expected[: 20 * 32 + 1])


def test_interrupted_job_resumes_to_the_same_shards(inputs, monkeypatch, capsys) -> None:
    assert tokenize_main(_args(inputs, "whole2")) == 0
    commits = {"n": 0}
    real_commit = arrayrecord.ShardWriter.commit

    def crash_on_third(self):
        commits["n"] += 1
        if commits["n"] == 3:
            raise KeyboardInterrupt  # as if the job were killed while finishing shard 2
        return real_commit(self)

    monkeypatch.setattr(arrayrecord.ShardWriter, "commit", crash_on_third)
    assert tokenize_main(_args(inputs, "split")) == 130  # Ctrl-C: one line, no traceback (cli._command)
    monkeypatch.undo()
    partial = json.loads((inputs / "split" / "manifest.json").read_text())
    assert len(partial["shards"]) == 2 and not partial["complete"]
    assert not list((inputs / "split").glob("*.tmp"))
    with pytest.raises(Exception, match="unfinished"):
        make_input(DataConfig(path=str(inputs / "split")), seq_len=8, batch_size=1, vocab_size=512)
    capsys.readouterr()
    assert tokenize_main(_args(inputs, "split")) == 0
    out = capsys.readouterr()
    assert "resuming after shard 1" in out.err and "(2 already there, resumed)" in out.out
    assert _shard_bytes(inputs / "split") == _shard_bytes(inputs / "whole2")
    whole = json.loads((inputs / "whole2" / "manifest.json").read_text())
    resumed = json.loads((inputs / "split" / "manifest.json").read_text())
    assert resumed == whole


def test_another_jobs_output_is_refused(inputs, capsys) -> None:
    assert tokenize_main(_args(inputs, "job")) == 0
    argv = _args(inputs, "job")
    argv[argv.index("--shard-tokens") + 1] = "2000"
    assert tokenize_main(argv) == 2
    assert "holds another job" in capsys.readouterr().err
    assert tokenize_main(_args(inputs, "job") + ["--text-field", "body"]) == 2
    assert tokenize_main(["--input", str(inputs / "nowhere"), "--tokenizer", "bytes", "--output", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
