"""Tokenizers (`data.tokenizer`): bytes, tokenizers JSON, transformers directories, sentencepiece,
the vocabulary check against the model, and the errors."""

from __future__ import annotations

import importlib.util
import io
import json
import pathlib

import numpy as np
import pytest
from data_helpers import documents, train_bpe

from xmoe_jax.cli import train_main
from xmoe_jax.config import ConfigError, DataConfig
from xmoe_jax.data import BYTES_EOS, make_input
from xmoe_jax.data.sources import tokenize_documents
from xmoe_jax.data.tokenizer import load_tokenizer

TEXTS = documents(300)
SAMPLE = "The old king loves the river. The fool fears the night."


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, pathlib.Path]:
    """A BPE tokenizer.json, a transformers-style directory and a sentencepiece model."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tokenizers")
    bpe = train_bpe(TEXTS, root / "bpe" / "tokenizer.json")
    hf_dir = root / "hf_dir"
    train_bpe(TEXTS + ["<eos>"], hf_dir / "tokenizer.json")
    # a transformers directory names its eos in tokenizer_config.json (here one added to the vocab)
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    new_id = max(tok_json["model"]["vocab"].values()) + 1
    tok_json["added_tokens"].append(
        {"id": new_id, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
    )
    (hf_dir / "tokenizer.json").write_text(json.dumps(tok_json))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS), model_writer=model, vocab_size=120, hard_vocab_limit=False
    )
    sp = root / "sp.model"
    sp.write_bytes(model.getvalue())
    return {"bpe": bpe, "hf_dir": hf_dir, "sp": sp, "root": root}


def test_bytes_tokenizer() -> None:
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eos_id) == (256, BYTES_EOS)
    ids = tok.encode_batch([SAMPLE, "é"])
    assert ids[0] == list(SAMPLE.encode()) and ids[1] == [0xC3, 0xA9]
    assert tok.decode(ids[0]) == SAMPLE


def test_tokenizers_json(made) -> None:
    from tokenizers import Tokenizer

    tok = load_tokenizer(str(made["bpe"]))
    ref = Tokenizer.from_file(str(made["bpe"]))
    assert tok.vocab_size == ref.get_vocab_size() and tok.eos_id == ref.token_to_id("<|endoftext|>")
    (ids,) = tok.encode_batch([SAMPLE])
    assert ids == ref.encode(SAMPLE).ids and tok.decode(ids) == SAMPLE
    assert len(ids) < len(SAMPLE) / 2  # BPE merges: far fewer ids than bytes


def test_transformers_directory_eos_from_config(made) -> None:
    tok = load_tokenizer(str(made["hf_dir"]))
    tok_json = json.loads((made["hf_dir"] / "tokenizer.json").read_text())
    assert tok.eos_id == tok_json["added_tokens"][-1]["id"] == tok.vocab_size - 1
    assert tok.decode(tok.encode_batch([SAMPLE])[0]) == SAMPLE


def test_sentencepiece(made) -> None:
    import sentencepiece as spm

    tok = load_tokenizer(str(made["sp"]))
    ref = spm.SentencePieceProcessor(model_file=str(made["sp"]))
    assert (tok.vocab_size, tok.eos_id) == (ref.get_piece_size(), ref.eos_id())
    (ids,) = tok.encode_batch([SAMPLE])
    assert ids == ref.encode(SAMPLE) and tok.decode(ids) == SAMPLE


def test_documents_are_packed_with_the_tokenizers_eos(made, tmp_path) -> None:
    """A jsonl of documents through make_input is encode(doc) + [eos] back to back."""
    docs = TEXTS[:40]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = load_tokenizer(str(made["bpe"]))
    expected = np.concatenate([np.asarray(ids + [tok.eos_id]) for ids in tok.encode_batch(docs)])
    np.testing.assert_array_equal(tokenize_documents(docs, tok), expected)
    cfg = DataConfig(path=str(tmp_path / "c.jsonl"), tokenizer=str(made["bpe"]), shuffle=False)
    it = make_input(cfg, seq_len=8, batch_size=1, vocab_size=tok.vocab_size)
    windows = [next(it) for _ in range(5)]
    stream = np.concatenate([w["inputs"][0] for w in windows] + [windows[-1]["targets"][0, -1:]])
    np.testing.assert_array_equal(stream, expected[: 5 * 8 + 1])


def test_vocab_mismatch_names_both_sizes(made, tmp_path, capsys) -> None:
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": SAMPLE}) + "\n")
    tok = load_tokenizer(str(made["bpe"]))
    cfg = DataConfig(path=str(tmp_path / "c.jsonl"), tokenizer=str(made["bpe"]))
    with pytest.raises(ConfigError) as err:
        make_input(cfg, seq_len=4, batch_size=1, vocab_size=100)
    msg = str(err.value)
    assert "model.vocab_size=100" in msg and f"({tok.vocab_size} ids)" in msg and str(made["bpe"]) in msg
    run = tmp_path / "run"
    argv = [f"data.path={tmp_path / 'c.jsonl'}", f"data.tokenizer={made['bpe']}", "model.vocab_size=100"]
    argv += [f"train.run_dir={run}"]
    assert train_main([x for kv in argv for x in ("--set", kv)]) == 2  # the CLI: one line, exit 2
    assert capsys.readouterr().err.strip() == f"error: {msg}" and not run.exists()


@pytest.mark.parametrize(
    "name, words",
    [
        ("missing.json", ["does not exist", "'bytes'"]),
        ("odd.txt", ["unknown tokenizer file type '.txt'"]),
        ("noeos/tokenizer.json", ["no end-of-document token", "eos_token"]),
        ("broken.json", ["is not a tokenizers JSON file"]),
    ],
)
def test_tokenizer_errors(made, name, words) -> None:
    root = made["root"]
    (root / "odd.txt").write_text("x")
    (root / "broken.json").write_text("{}")
    if name.startswith("noeos"):
        train_bpe(TEXTS[:20], root / "noeos" / "tokenizer.json")
        data = json.loads((root / "noeos" / "tokenizer.json").read_text())
        data["added_tokens"] = []
        data["model"]["vocab"].pop("<|endoftext|>")
        (root / "noeos" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(root / name))
    for word in words:
        assert word in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed")
def test_directory_without_tokenizer_json_needs_transformers(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="needs transformers"):
        load_tokenizer(str(tmp_path))


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is optional and not installed"
)
def test_transformers_directory_without_tokenizer_json(made, tmp_path) -> None:
    """vocab.json + merges.txt + tokenizer_config.json: only transformers.AutoTokenizer reads it."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(made["bpe"]))
    ref.model.save(str(tmp_path))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert type(tok).__name__ == "TransformersTokenizer"
    assert (tok.vocab_size, tok.eos_id) == (ref.get_vocab_size(), ref.token_to_id("<|endoftext|>"))
    (ids,) = tok.encode_batch([SAMPLE])
    assert ids == ref.encode(SAMPLE).ids and tok.decode(ids) == SAMPLE
