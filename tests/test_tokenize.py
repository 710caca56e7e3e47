"""`xmoe-tokenize`: shards and summary, an interrupted job resumed equals an uninterrupted one,
another job's output is refused, and the trainer reads the result. Bad input is one line, status 2
(issue 31): a damaged manifest.json, inputs edited before a resume, --shard-tokens 0, an --output
that is a file, an output another xmoe-tokenize holds; Ctrl-C is one line. An --output whose folders
do not exist is created; a write that fails (a full disk) is one line, status 1, no partial file
(issue 37)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import documents, train_bpe, write_jsonl, write_parquet

from xmoe_jax.cli import tokenize_main
from xmoe_jax.config import ConfigError, DataConfig
from xmoe_jax.data import arrayrecord, load_tokenizer, make_input
from xmoe_jax.train import runlock

DOCS = documents(400, seed=3)
LOCK_NAME = "tokenize.lock"  # in the output folder while a job runs


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
    capsys.readouterr()
    assert tokenize_main(_args(inputs, "split")) == 130  # Ctrl-C: one line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("xmoe-tokenize: interrupted;") and "run the same command to resume" in err[-1]
    monkeypatch.undo()
    assert not (inputs / "split" / LOCK_NAME).exists()  # released
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


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_damaged_manifest_is_named_by_tokenize_and_train(inputs, capsys) -> None:
    assert tokenize_main(_args(inputs, "damaged")) == 0
    manifest = inputs / "damaged" / "manifest.json"
    manifest.write_text(manifest.read_text()[:60])  # truncated
    capsys.readouterr()
    assert tokenize_main(_args(inputs, "damaged")) == 2
    line = _one_line_error(capsys)
    assert f"{manifest} is damaged (Unterminated string" in line and "xmoe-tokenize command again" in line
    with pytest.raises(ConfigError, match=r"manifest.json is damaged \(Unterminated string"):
        make_input(DataConfig(path=str(inputs / "damaged")), seq_len=8, batch_size=1, vocab_size=512)


def test_a_resume_over_edited_inputs_is_refused_naming_the_file(
    inputs, tmp_path, monkeypatch, capsys
) -> None:
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", DOCS[:150])
    write_jsonl(corpus / "b.jsonl", DOCS[150:])
    argv = [*_args(inputs, "edited"), "--input", str(corpus)]
    monkeypatch.setattr(arrayrecord.ShardWriter, "commit", _interrupt_on_call(2))
    assert tokenize_main(argv) == 130
    monkeypatch.undo()
    write_jsonl(corpus / "a.jsonl", list(reversed(DOCS[:150])))  # edited between the runs
    capsys.readouterr()
    assert tokenize_main(argv) == 2
    line = _one_line_error(capsys)
    assert "a.jsonl has other content at the same size" in line and "would mix its old and new text" in line
    write_jsonl(corpus / "a.jsonl", DOCS[:150])  # restored: the job goes on
    assert tokenize_main(argv) == 0


def _interrupt_on_call(n: int):
    real = arrayrecord.ShardWriter.commit
    calls = {"n": 0}

    def commit(self):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(self)

    return commit


def test_bad_shard_tokens_and_output_paths_are_one_line(inputs, tmp_path, capsys) -> None:
    base = ["--input", str(inputs / "corpus"), "--tokenizer", "bytes"]
    assert tokenize_main([*base, "--output", str(tmp_path / "zero"), "--shard-tokens", "0"]) == 2
    assert "--shard-tokens=0 must be >= 1" in _one_line_error(capsys)
    assert not (tmp_path / "zero").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert tokenize_main([*base, "--output", str(afile)]) == 2
    assert f"--output {afile} is a file, not a folder" in _one_line_error(capsys)
    assert tokenize_main([*base, "--output", str(afile / "sub")]) == 2
    assert f"is under {afile}, a file" in _one_line_error(capsys)


def test_an_output_whose_folders_do_not_exist_is_created(inputs, tmp_path, monkeypatch, capsys) -> None:
    """Issue 37 3.4: the README's `--output data/corpus`, run in a project without data/, was refused."""
    monkeypatch.chdir(tmp_path)
    argv = ["--input", str(inputs / "corpus" / "a.jsonl"), "--tokenizer", "bytes", "--output", "data/corpus"]
    assert tokenize_main(argv) == 0
    assert (tmp_path / "data" / "corpus" / "manifest.json").is_file()
    assert "done:" in capsys.readouterr().out


# a tokenize job under a file-size limit of `limit` bytes (a full disk, a quota: the same errors)
LIMITED = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from xmoe_jax.cli import tokenize_main
sys.exit(tokenize_main(sys.argv[2:]))
"""


@pytest.mark.parametrize("limit", [40_000, 2_000, 100], ids=["shard", "tokenizer-copy", "lock"])
def test_a_write_that_fails_is_one_line_and_leaves_no_partial_file(inputs, tmp_path, limit) -> None:
    """Issue 37 3.3: a full disk or a quota (`ulimit -f` here) printed a 21-33-line traceback and left
    the unfinished shard behind. Now: one line naming the file and the fix, status 1, no partial
    file; the same command then resumes."""
    out = tmp_path / "out"
    argv = [*_args(inputs, "unused"), "--output", str(out), "--input", str(inputs / "corpus" / "a.jsonl")]
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, str(limit), *argv], capture_output=True, text=True, timeout=120
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"error: {out}/") and "could not be written (File too large)" in lines[0]
    assert "then run the same command: it resumes after the last finished shard" in lines[0]
    assert not [p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".partial"))]
    if limit < 7000:  # failed while copying the tokenizer (7.7 kB): no half copy
        assert not (out / "tokenizer").exists()
    assert tokenize_main(argv) == 0
    assert tokenize_main([*argv, "--output", str(tmp_path / "reference")]) == 0
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "reference")


def test_a_second_tokenizer_on_one_output_is_refused_naming_the_first(inputs, tmp_path, capsys) -> None:
    out = tmp_path / "locked"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # a live xmoe-tokenize holds the output's lock
        holder = {**runlock._me(), "pid": other.pid, "start_time": runlock._start_time(other.pid)}
        (out / LOCK_NAME).write_text(json.dumps({**holder, "command": "xmoe-tokenize --output locked"}))
        argv = [*_args(inputs, "unused"), "--output", str(out)]
        assert tokenize_main(argv) == 2
        line = _one_line_error(capsys)
        assert f"{out} is in use by another xmoe-tokenize: pid {other.pid}" in line
        assert "choose another --output" in line and str(out / LOCK_NAME) in line
        assert not (out / "manifest.json").exists()
    finally:
        other.kill()
        other.wait()
    assert tokenize_main(argv) == 0  # its holder gone: the lock is taken over
    assert not (out / LOCK_NAME).exists() and os.listdir(out)
