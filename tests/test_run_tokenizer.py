"""A run remembers the tokenizer its data was made with (`xmoe_jax/data/provenance.py`).

The README's "Your data" path: `xmoe-tokenize --tokenizer tokenizer.json`, then `xmoe-train
--set data.path=data/corpus` with no data.tokenizer. Before: the run recorded `bytes`,
`xmoe-generate` died in a traceback, `--set data.tokenizer` on it came too late, and `xmoe-eval`
on other text tokenized it as bytes. Checked here: xmoe-tokenize keeps a copy and a fingerprint;
the trainer takes the data's tokenizer and refuses a different explicit one before compiling;
the run keeps a copy; generate uses it (eval: `tests/test_eval_watch.py`). A damaged copy, beside
the shards or in the run, is named where it is first read (issue 37 3.5).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import yaml
from data_helpers import documents, train_bpe, write_jsonl

from xmoe_jax.cli import train_main
from xmoe_jax.cli_models import generate_main
from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.data import load_tokenizer, provenance
from xmoe_jax.data.tokenize import tokenize_to_shards
from xmoe_jax.train.rundir import RunDir

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
SMALL = ["--set", "train.steps=2", "--set", "train.log_every=1", "--set", "train.seq_len=32"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """documents, a BPE tokenizer (512 ids), xmoe-tokenize output made with it, a second tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    docs = documents(1500, seed=3)
    write_jsonl(root / "docs" / "train.jsonl", docs)
    train_bpe(docs, root / "tokenizer.json", vocab_size=512)
    train_bpe(docs[:300], root / "other" / "tokenizer.json", vocab_size=400)
    tokenize_to_shards(str(root / "docs"), str(root / "tokenizer.json"), root / "data" / "corpus")
    return root


def test_tokenize_keeps_a_copy_and_a_fingerprint(corpus) -> None:
    out = corpus / "data" / "corpus"
    manifest = json.loads((out / "manifest.json").read_text())
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()
    assert manifest["tokenizer_sha256"] == provenance.fingerprint(str(corpus / "tokenizer.json"))
    assert provenance.fingerprint(str(out / "tokenizer")) == manifest["tokenizer_sha256"]
    assert provenance.fingerprint("bytes") == "bytes"


def test_data_tokenizer_defaults_to_the_datas(corpus) -> None:
    cfg = load_config(TINY, [f"data.path={corpus / 'data' / 'corpus'}", "model.vocab_size=512"])
    assert cfg.data.tokenizer == "auto"  # before: 'bytes', and the run recorded it
    resolved = provenance.resolve(cfg)
    assert resolved.data.tokenizer == str(corpus / "data" / "corpus" / "tokenizer")
    assert load_tokenizer(resolved.data.tokenizer).vocab_size == 512
    assert provenance.resolve(load_config(TINY)).data.tokenizer == "bytes"  # synthetic data
    same = load_config(
        TINY, [f"data.path={corpus / 'data' / 'corpus'}", f"data.tokenizer={corpus / 'tokenizer.json'}"]
    )
    assert provenance.resolve(same).data.tokenizer == str(corpus / "tokenizer.json")  # the same file: fine


@pytest.mark.parametrize("tokenizer", ["other/tokenizer.json", "bytes"])
def test_a_different_tokenizer_is_refused_before_training(corpus, tokenizer, capsys, tmp_path) -> None:
    argv = [
        "--config",
        TINY,
        "--set",
        f"data.path={corpus / 'data' / 'corpus'}",
        "--set",
        "model.vocab_size=512",
    ]
    name = str(corpus / tokenizer) if tokenizer != "bytes" else tokenizer
    argv += ["--set", f"data.tokenizer={name}", "--set", f"train.run_dir={tmp_path / 'run'}", *SMALL]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"data.tokenizer={name!r} is not the tokenizer data.path=" in err
        and "leave data.tokenizer unset" in err
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written or compiled


@pytest.mark.parametrize("damage", ["truncated", "edited"])
def test_a_damaged_tokenizer_beside_the_shards_is_named_before_training(corpus, damage, tmp_path, capsys):
    """Issue 37 3.5: the trainer copied it into the run without a word; xmoe-generate then blamed a
    data.tokenizer setting the user never made."""
    data = tmp_path / "corpus"
    shutil.copytree(corpus / "data" / "corpus", data)
    copy = data / "tokenizer" / "tokenizer.json"
    if damage == "truncated":
        copy.write_text(copy.read_text()[:500])
    else:  # reads, but is not the tokenizer the ids were made with
        shutil.copyfile(corpus / "other" / "tokenizer.json", copy)
    run = tmp_path / "run"
    argv = ["--config", TINY, "--set", f"data.path={data}", "--set", "model.vocab_size=512"]
    assert train_main([*argv, "--set", f"train.run_dir={run}", *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(copy) in err[0] and "data.tokenizer" not in err[0], err
    assert f"the copy of the tokenizer data.path={str(data)!r} was made with" in err[0]
    assert "run the xmoe-tokenize command again" in err[0] and not run.exists()


def test_generate_names_a_damaged_copy_of_the_runs_tokenizer(corpus, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "auto"}}))
    copy = run / "tokenizer" / "tokenizer.json"
    copy.write_text((corpus / "tokenizer.json").read_text()[:500])
    assert generate_main(["--run-dir", str(run), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and str(copy) in err[0] and f"data.tokenizer={str(run / 'tokenizer')!r}" not in err[0]
    )
    assert (
        f"is the copy of the tokenizer {run} was trained with" in err[0] and "--set data.tokenizer=" in err[0]
    )


def test_bytes_decode_of_large_ids_does_not_raise() -> None:
    assert load_tokenizer("bytes").decode([72, 105, 300]) == "Hi\ufffd"  # before: ValueError


def test_generate_applies_its_overrides_before_loading_the_tokenizer(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "bytes"}}))
    missing = str(tmp_path / "missing.json")
    argv = ["--run-dir", str(run), "--prompt", "hi", "--set", f"data.tokenizer={missing}"]
    assert generate_main(argv) == 2
    assert f"data.tokenizer={missing!r} does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mine(corpus, tmp_path_factory) -> pathlib.Path:
    """The README's run: xmoe-tokenize output, no data.tokenizer, 1% held out."""
    run = tmp_path_factory.mktemp("runs") / "mine"
    argv = [
        "--config",
        TINY,
        "--set",
        f"data.path={corpus / 'data' / 'corpus'}",
        "--set",
        "model.vocab_size=512",
    ]
    argv += ["--set", "eval.holdout=0.01", "--set", f"train.run_dir={run}", *SMALL]
    assert train_main(argv) == 0
    return run


@pytest.mark.slow  # a training run (compiles: ~20 s alone, more on a busy machine)
def test_the_run_records_and_keeps_its_tokenizer(corpus, mine) -> None:
    cfg = yaml.safe_load((mine / "config.yaml").read_text())
    assert cfg["data"]["tokenizer"] == str(corpus / "data" / "corpus" / "tokenizer")  # before: bytes
    assert (mine / "tokenizer" / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()


@pytest.mark.slow  # the training run and a generation compile
def test_generate_decodes_with_the_runs_tokenizer(mine, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # the run's copy, not a path relative to where it trained
    argv = ["--run-dir", str(mine), "--prompt", "The king", "--max-tokens", "4", "--temperature", "0"]
    assert generate_main(argv) == 0, capsys.readouterr().err  # before: ValueError from bytes()
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("The king")  # BPE pieces decoded (2 steps: not yet English)


@pytest.mark.slow  # the training run
def test_tools_refuse_a_tokenizer_the_data_was_not_made_with(corpus, mine, tmp_path) -> None:
    """A run written before runs kept copies (config.yaml: bytes) is refused with the fix, not decoded wrong."""
    old = tmp_path / "old"
    old.mkdir()
    cfg = yaml.safe_load((mine / "config.yaml").read_text())
    cfg["data"]["tokenizer"] = "bytes"
    (old / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="is not the tokenizer data.path="):
        provenance.for_tools(RunDir(old).tokenizer, load_config(old / "config.yaml"), [])
    fixed = provenance.for_tools(
        RunDir(old).tokenizer,
        load_config(old / "config.yaml", ["data.tokenizer=auto"]),
        ["data.tokenizer=auto"],
    )
    assert fixed.data.tokenizer == str(corpus / "data" / "corpus" / "tokenizer")
