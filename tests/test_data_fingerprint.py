"""Data that cannot change under a run (issue 31, item 2): a checkpoint records what its data
position indexes into, and `--resume` on other data (re-tokenized shards, a much smaller corpus, a
reordered `.jsonl`) is refused before compiling, naming the change and `--new-data`; with that
flag the data starts at its position 0. Checkpoints without a fingerprint resume as before."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from data_helpers import documents, write_corpus, write_jsonl

from xmoe_jax.config import ConfigError, DataConfig, SourceConfig
from xmoe_jax.data import fingerprint
from xmoe_jax.data.tokenize import tokenize_to_shards

DOCS = documents(120, seed=5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprint")
    return root, write_corpus(root / "corpus", DOCS)


def _print(path: str, **source) -> dict:
    return fingerprint.of_data(DataConfig(path=path, **source))


def _fake_checkpoint(root, step: int, data_print: dict | None):
    """A checkpoints folder whose step holds a manifest (as `Checkpointer.save` writes it)."""
    manifest = root / "checkpoints" / str(step) / "manifest"
    manifest.mkdir(parents=True)
    body = {"step": step} | ({fingerprint.MANIFEST_KEY: data_print} if data_print is not None else {})
    (manifest / "metadata").write_text(json.dumps(body))
    return root / "checkpoints"


def test_every_kind_has_a_stable_fingerprint_and_a_moved_corpus_keeps_it(corpus, tmp_path) -> None:
    root, paths = corpus
    for kind, path in paths.items():
        src = {"text_field": "body"} if kind == "parquet" else {}
        now = _print(path, **src)
        assert now == _print(path, **src), kind
        assert fingerprint.describe_change(now, now) is None
        assert now["sources"][0]["kind"] in ("files", "hf", "arrayrecord", "megatron"), kind
    moved = tmp_path / "elsewhere"
    shutil.copytree(root / "corpus" / "jsonl", moved)
    was = _print(paths["jsonl"])
    assert fingerprint.describe_change(was, _print(str(moved / "*.jsonl"))) is None


def test_a_reordered_smaller_or_extended_jsonl_is_named(tmp_path) -> None:
    path = write_jsonl(tmp_path / "c" / "part.jsonl", DOCS)
    was = _print(str(tmp_path / "c"))
    write_jsonl(path, list(reversed(DOCS)))  # same bytes, other order
    assert fingerprint.describe_change(was, _print(str(tmp_path / "c"))) == (
        f"data.path={str(tmp_path / 'c')!r}: part.jsonl has other content at the same size (edited or reordered)"
    )
    write_jsonl(path, DOCS[:10])
    change = fingerprint.describe_change(was, _print(str(tmp_path / "c")))
    assert change.endswith(f"part.jsonl is {path.stat().st_size:,} bytes, was {was['sources'][0]['bytes']:,}")
    write_jsonl(path, DOCS)
    write_jsonl(tmp_path / "c" / "more.jsonl", DOCS[:3])
    assert fingerprint.describe_change(was, _print(str(tmp_path / "c"))).endswith("more.jsonl is new")
    assert "text_field is 'body', was 'text'" in fingerprint.describe_change(
        _print(str(path)), _print(str(path), text_field="body")
    )


def test_retokenized_shards_and_a_mixture_change_are_named(corpus, tmp_path) -> None:
    root, paths = corpus
    tokenize_to_shards(str(root / "corpus" / "jsonl"), "bytes", tmp_path / "again", shard_tokens=300)
    was = _print(paths["arrayrecord"])  # written with shard_tokens=500
    change = fingerprint.describe_change(was, _print(str(tmp_path / "again")))
    assert change.startswith(f"data.path={str(tmp_path / 'again')!r}: its manifest.json differs")
    assert "shard(s)" in change and "tokens" in change
    two = fingerprint.of_data(DataConfig(mixture=(SourceConfig(path=paths["jsonl"]), SourceConfig())))
    assert fingerprint.describe_change(was, two) == "the data has 2 source(s), the checkpoint's had 1"
    assert fingerprint.describe_change(_print(paths["jsonl"]), was).startswith(
        f"data.path={paths['arrayrecord']!r} is arrayrecord data, the checkpoint's was files"
    )


def test_resume_on_changed_data_is_refused_naming_the_flag(tmp_path) -> None:
    path = write_jsonl(tmp_path / "c" / "part.jsonl", DOCS)
    was = _print(str(path))
    checkpoints = _fake_checkpoint(tmp_path, 8, was)
    assert fingerprint.check_resume(checkpoints, 8, was, new_data=False)  # same data: the saved position
    write_jsonl(path, DOCS[:20])
    now = _print(str(path))
    with pytest.raises(ConfigError) as err:
        fingerprint.check_resume(checkpoints, 8, now, new_data=False)
    message = str(err.value)
    assert message.startswith("--resume: the data changed since checkpoint step 8")
    assert "part.jsonl is" in message and "--new-data" in message and "\n" not in message
    assert fingerprint.check_resume(checkpoints, 8, now, new_data=True) is False  # position 0 of the new data


def test_a_checkpoint_without_a_fingerprint_resumes_as_before_and_says_so(tmp_path, caplog) -> None:
    checkpoints = _fake_checkpoint(tmp_path, 4, None)
    now = _print(str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    with caplog.at_level(logging.INFO, logger="xmoe_jax"):
        assert fingerprint.check_resume(checkpoints, 4, now, new_data=False)
    assert "records no data fingerprint" in caplog.text
    assert fingerprint.check_resume(checkpoints, 4, now, new_data=True) is False


def test_the_fingerprint_is_sealed_in_the_checkpoint_manifest() -> None:
    from xmoe_jax.train import integrity

    data_print = {"version": 1, "sources": [{"kind": "synthetic", "where": "x", "digest": ""}]}
    manifest = integrity.build_manifest(3, {}, None, None, data_print)
    assert integrity.check_manifest(manifest, 3)[fingerprint.MANIFEST_KEY] == data_print
    manifest[fingerprint.MANIFEST_KEY] = {"version": 1, "sources": []}  # altered: the checksum sees it
    with pytest.raises(integrity.IntegrityError, match="checksum"):
        integrity.check_manifest(manifest, 3)
    old = integrity.build_manifest(3, {}, None, None)  # without one: as before
    assert fingerprint.MANIFEST_KEY not in old


@pytest.mark.slow  # three short runs of the tiny model (5 min on 2 shared CPU cores)
def test_resume_on_changed_data_is_refused_and_new_data_starts_at_position_0(tmp_path, capsys) -> None:
    from clirun import args, tiny_config

    from xmoe_jax.cli import train_main
    from xmoe_jax.train.loop import train

    path = write_jsonl(tmp_path / "corpus" / "part.jsonl", documents(400, seed=9))
    run = tmp_path / "run"
    sets = (f"data.path={path}", "train.seq_len=32", "checkpoint.every=2", "checkpoint.async_save=false")
    train(tiny_config(run, *sets, "train.steps=4"))
    saved = fingerprint.saved(run / "checkpoints", 4)
    assert saved == fingerprint.of_data(tiny_config(run, *sets).data)

    write_jsonl(path, documents(400, seed=9)[:60])  # a much smaller corpus
    assert train_main([*args(run, *sets, "train.steps=6"), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --resume: the data changed since checkpoint step 4")
    assert "part.jsonl is" in err[-1] and "--new-data" in err[-1]
    assert "compiling" not in "".join(err)  # refused before anything compiled
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]

    result = train(tiny_config(run, *sets, "train.steps=6"), resume=True, new_data=True)
    assert sorted(result.losses) == [5, 6]
    position = json.loads(next((run / "checkpoints" / "6" / "data").glob("process_*.json")).read_text())
    assert position["next_index"] == 2  # two batches of the new data, from its start
    assert fingerprint.saved(run / "checkpoints", 6) == fingerprint.of_data(tiny_config(run, *sets).data)
