"""Datasets (`data.path` / `data.mixture`): every kind reads the same documents packed the same
way, is detected from its path, resumes exactly, mixes by weight, holds out eval windows, and
bad input fails with one clear line. Corpora are made in the test (data_helpers.py)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from data_helpers import byte_stream, documents, write_corpus, write_jsonl

from xmoe_jax.config import (
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    SourceConfig,
    TrainConfig,
    from_dict,
    to_dict,
)
from xmoe_jax.data import make_eval_input, make_input
from xmoe_jax.data.sources import detect_kind

DOCS = documents(120)
SEQ = 16
KINDS = {  # fixture key -> (detected kind, extra source fields)
    "jsonl": ("files", {}),
    "parquet": ("files", {"text_field": "body"}),
    "txt": ("files", {}),
    "hf": ("hf", {}),
    "hf_dict": ("hf", {"split": "train"}),
    "arrow": ("hf", {}),
    "arrayrecord": ("arrayrecord", {}),
    "megatron": ("megatron", {}),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    return write_corpus(tmp_path_factory.mktemp("corpus"), DOCS)


def _cfg(path: str, **kw) -> DataConfig:
    return DataConfig(path=path, **kw)


def _stream(it, num: int) -> np.ndarray:
    """The token stream of `num` unshuffled batches of one window each."""
    windows = [next(it) for _ in range(num)]
    return np.concatenate([w["inputs"][0] for w in windows] + [windows[-1]["targets"][0, -1:]])


def _take(it, n: int) -> list[np.ndarray]:
    return [next(it)["inputs"] for _ in range(n)]


@pytest.mark.parametrize("key", sorted(KINDS))
def test_every_kind_packs_the_same_documents(corpus, key) -> None:
    kind, extra = KINDS[key]
    src = SourceConfig(path=corpus[key], **extra)
    assert detect_kind(src, "data.") == kind
    it = make_input(_cfg(corpus[key], shuffle=False, **extra), seq_len=SEQ, batch_size=1, vocab_size=256)
    num = 30
    np.testing.assert_array_equal(_stream(it, num), byte_stream(DOCS)[: num * SEQ + 1])


@pytest.mark.parametrize("key", sorted(KINDS))
def test_state_round_trip(corpus, key) -> None:
    cfg = _cfg(corpus[key], seed=4, **KINDS[key][1])
    make = lambda: make_input(cfg, seq_len=SEQ, batch_size=4, vocab_size=256)  # noqa: E731
    it = make()
    _take(it, 7)
    state = it.get_state()
    expected = _take(it, 5)
    fresh = make()
    fresh.set_state(state)
    for a, b in zip(_take(fresh, 5), expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mixture_follows_weights_and_resumes(corpus, tmp_path) -> None:
    """Source b holds the same documents shifted to ids >= 128, so every window names its source."""
    from xmoe_jax.data.megatron import write_megatron

    write_megatron(tmp_path / "shifted", [byte_stream([d]) + 128 for d in DOCS])
    cfg = DataConfig(
        mixture=(
            SourceConfig(path=corpus["arrayrecord"], weight=3.0),
            SourceConfig(path=str(tmp_path / "shifted"), weight=1.0),
        ),
        shuffle=False,
    )
    it = make_input(cfg, seq_len=SEQ, batch_size=1, vocab_size=256)
    seen = [next(it)["inputs"][0] for _ in range(80)]
    from_b = [bool(w.min() >= 128) for w in seen]
    assert all(from_b[i] == bool(w.max() >= 128) for i, w in enumerate(seen))  # no window is mixed
    assert sum(from_b) == 20  # weights 3:1
    stream = byte_stream(DOCS)
    a_windows = [w for w, b in zip(seen, from_b, strict=True) if not b]
    b_windows = [w - 128 for w, b in zip(seen, from_b, strict=True) if b]
    for order in (a_windows, b_windows):  # each source is read in its own order
        for i, w in enumerate(order):
            np.testing.assert_array_equal(w, stream[i * SEQ : i * SEQ + SEQ])
    state = it.get_state()
    expected = _take(it, 6)
    fresh = make_input(cfg, seq_len=SEQ, batch_size=1, vocab_size=256)
    fresh.set_state(state)
    for a, b in zip(_take(fresh, 6), expected, strict=True):
        np.testing.assert_array_equal(a, b)


def _config(data: DataConfig, holdout: float = 0.0, steps: int = 2, eval_data=None) -> Config:
    return Config(
        data=data,
        eval=EvalConfig(every=1, steps=steps, holdout=holdout, data=eval_data),
        train=TrainConfig(seq_len=SEQ, batch_size=2),
    )


def test_holdout_is_disjoint_from_training_and_fixed(corpus) -> None:
    data = _cfg(corpus["megatron"], shuffle=False)
    num_windows = (len(byte_stream(DOCS)) - 1) // SEQ
    num_held = int(np.ceil(0.1 * num_windows))
    train_it = make_input(data, seq_len=SEQ, batch_size=1, vocab_size=256, holdout=0.1)
    train = [tuple(next(train_it)["inputs"][0]) for _ in range(num_windows - num_held)]
    assert tuple(next(train_it)["inputs"][0]) == train[0]  # the training epoch ends before the held-out tail
    cfg = _config(data, holdout=0.1, steps=num_held // 2)
    batches = make_eval_input(cfg)
    assert len(batches) == num_held // 2
    held = [tuple(row) for i in range(len(batches)) for row in batches[i]["inputs"]]
    assert not set(held) & set(train)
    stream = byte_stream(DOCS)
    first_held = num_windows - num_held
    np.testing.assert_array_equal(held[0], stream[first_held * SEQ : first_held * SEQ + SEQ])
    again = make_eval_input(cfg)
    for i in range(len(batches)):  # every evaluation reads the same batches
        np.testing.assert_array_equal(again[i]["inputs"], batches[i]["inputs"])


def test_eval_on_another_dataset(corpus) -> None:
    cfg = _config(_cfg(corpus["jsonl"]), eval_data=SourceConfig(path=corpus["parquet"], text_field="body"))
    batches = make_eval_input(cfg)
    np.testing.assert_array_equal(batches[0]["inputs"][0], byte_stream(DOCS)[:SEQ])
    assert make_eval_input(Config(data=_cfg(corpus["jsonl"]))) is None  # no eval data configured


def test_process_shares_are_disjoint_and_cover(corpus) -> None:
    cfg = _cfg(corpus["arrayrecord"], seed=1)
    num_windows = (len(byte_stream(DOCS)) - 1) // SEQ
    seen = []
    for index in range(3):
        it = make_input(cfg, seq_len=SEQ, batch_size=1, vocab_size=256, process_index=index, process_count=3)
        seen += [tuple(next(it)["inputs"][0]) for _ in range(len(range(index, num_windows, 3)))]
    stream = byte_stream(DOCS)
    assert sorted(seen) == sorted(tuple(stream[i * SEQ : i * SEQ + SEQ]) for i in range(num_windows))


def _errors_corpus(root: pathlib.Path) -> None:
    write_jsonl(root / "nofield.jsonl", ["x"], field="body")
    (root / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    write_jsonl(root / "empty.jsonl", ["", ""])
    write_jsonl(root / "tiny.jsonl", ["abc"])
    (root / "odd").mkdir()
    (root / "odd" / "a.txt").write_text("a")
    (root / "odd" / "b.csv").write_text("b")
    (root / "unfinished").mkdir()
    (root / "unfinished" / "manifest.json").write_text(
        json.dumps({"format": "xmoe-tokens", "complete": False})
    )
    (root / "m.idx").write_bytes(b"NOTMEGATRON" + bytes(40))
    (root / "m.bin").write_bytes(b"")


@pytest.mark.parametrize(
    "path, extra, words",
    [
        ("missing.jsonl", {}, ["data.path=", "missing.jsonl", "does not exist"]),
        ("nothing/*.jsonl", {}, ["holds no .txt/.jsonl/.parquet files"]),
        ("nofield.jsonl", {}, ["nofield.jsonl:1 has no field 'text'", "['body', 'id']", "data.text_field"]),
        ("bad.jsonl", {}, ["bad.jsonl:2 is not JSON"]),
        ("empty.jsonl", {}, ["holds no documents"]),
        ("tiny.jsonl", {}, ["has 4 tokens", "needs at least 17 tokens"]),
        ("odd/*", {}, ["b.csv is not a .txt/.jsonl/.parquet file"]),
        ("unfinished", {"source": "arrayrecord"}, ["unfinished xmoe-tokenize output", "rerun"]),
        ("m", {}, ["no MMIDIDX header"]),
        ("parquet", {"root": "corpus"}, ["has no column 'text'", "['body']", "data.text_field"]),
        (
            "hf_dict",
            {"root": "corpus", "split": "valid"},
            ["splits ['test', 'train'], not 'valid'", "data.split"],
        ),
        ("arrayrecord", {"root": "corpus", "vocab": 100}, ["model.vocab_size=100", "(256 ids)"]),
        ("megatron", {"root": "corpus", "vocab": 100}, ["model.vocab_size=100", "largest id"]),
    ],
)
def test_bad_data_fails_with_one_clear_line(tmp_path, corpus, path, extra, words) -> None:
    _errors_corpus(tmp_path)
    extra = dict(extra)
    vocab = extra.pop("vocab", 256)
    full = corpus[path] if extra.pop("root", None) else str(tmp_path / path)
    with pytest.raises(ConfigError) as err:
        make_input(_cfg(full, **extra), seq_len=SEQ, batch_size=1, vocab_size=vocab)
    msg = str(err.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, msg


def test_holdout_too_small_and_config_errors(corpus) -> None:
    with pytest.raises(ConfigError, match="eval.holdout=0.001 keeps 1 window"):
        make_input(
            _cfg(corpus["jsonl"]), seq_len=SEQ, batch_size=1, vocab_size=256, holdout=0.001, process_count=2
        )
    for kwargs, words in [
        ({"source": "synthetic", "path": "x"}, "reads no data.path"),
        ({"path": "a", "mixture": (SourceConfig(path="b"),)}, "are alternatives"),
        ({"mixture": (SourceConfig(path="b", weight=0),)}, r"data.mixture\[0\].weight=0 must be > 0"),
        ({"source": "megatron"}, "needs data.path"),
    ]:
        with pytest.raises(ConfigError, match=words):
            DataConfig(**kwargs)
    with pytest.raises(ConfigError, match="needs eval data"):
        EvalConfig(every=10)
    with pytest.raises(ConfigError, match="alternatives"):
        EvalConfig(holdout=0.1, data=SourceConfig(path="x"))
    cfg = Config(
        data=DataConfig(mixture=(SourceConfig(path="a", weight=2.0),)),
        train=TrainConfig(profile_steps=(2, 3)),
    )
    plain = to_dict(cfg)  # lists, as config.yaml and checkpoints hold them
    assert isinstance(plain["data"]["mixture"], list) and plain["train"]["profile_steps"] == [2, 3]
    assert from_dict(json.loads(json.dumps(plain))) == cfg
