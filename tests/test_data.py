"""Input pipeline: determinism, shapes, exact resume (state and orbax), sharding, errors."""

from __future__ import annotations

import pathlib

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from data_helpers import SHARED_TEXT

from xmoe_jax.config import ConfigError, DataConfig
from xmoe_jax.data import SYNTHETIC_STRIDES, make_input

SEQ, BATCH, VOCAB = 16, 4, 256


def _corpus() -> pathlib.Path:
    return SHARED_TEXT  # shipped in the repository (data/README.md)


@pytest.fixture
def corpus() -> pathlib.Path:
    return _corpus()


@pytest.fixture
def small_text(tmp_path: pathlib.Path) -> pathlib.Path:
    """101 windows of 8+1 random bytes: windows are unique, so sets are meaningful."""
    path = tmp_path / "small.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 * 101 + 1, dtype=np.uint8).tobytes())
    return path


def _cfg(source: str, path: pathlib.Path | None = None, **kw) -> DataConfig:
    return DataConfig(source=source, path=None if path is None else str(path), **kw)


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])


@pytest.fixture(params=["synthetic", "text"])
def cfg(request) -> DataConfig:
    return _cfg("text", _corpus(), seed=3) if request.param == "text" else _cfg("synthetic", seed=3)


def test_deterministic_shapes_and_shift(cfg: DataConfig) -> None:
    make = lambda: make_input(cfg, seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB)  # noqa: E731
    a, b = _take(make(), 5), _take(make(), 5)
    _assert_same(a, b)
    for batch in a:
        assert set(batch) == {"inputs", "targets"}
        for arr_BS in batch.values():
            assert arr_BS.dtype == np.int32 and arr_BS.shape == (BATCH, SEQ)
            assert arr_BS.min() >= 0 and arr_BS.max() < VOCAB
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert not np.array_equal(a[0]["inputs"], a[1]["inputs"])


def test_synthetic_is_arithmetic_progression() -> None:
    vocab = 50
    it = make_input(_cfg("synthetic"), seq_len=SEQ, batch_size=BATCH, vocab_size=vocab)
    for batch in _take(it, 3):
        tokens_BW = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
        assert tokens_BW.max() < vocab
        diffs_BS = np.diff(tokens_BW, axis=1) % vocab
        assert (diffs_BS == diffs_BS[:, :1]).all()
        assert set(diffs_BS[:, 0].tolist()) <= set(SYNTHETIC_STRIDES)
    other = make_input(_cfg("synthetic", seed=1), seq_len=SEQ, batch_size=BATCH, vocab_size=vocab)
    assert not np.array_equal(next(other)["inputs"], batch["inputs"])


def test_state_round_trip(cfg: DataConfig) -> None:
    it = make_input(cfg, seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB)
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 2)
    fresh = make_input(cfg, seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB)
    fresh.set_state(state)
    _assert_same(_take(fresh, 2), expected)


def test_orbax_round_trip(tmp_path: pathlib.Path) -> None:
    cfg = _cfg("synthetic", seed=7)
    it = make_input(cfg, seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB)
    _take(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
    expected = _take(it, 2)
    fresh = make_input(cfg, seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.latest_step() == 3
        mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    _assert_same(_take(fresh, 2), expected)


def test_text_decodes_to_file_bytes(corpus: pathlib.Path) -> None:
    num_batches = 10
    it = make_input(_cfg("text", corpus, shuffle=False), seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB)
    batches = _take(it, num_batches)
    stream = np.concatenate([b["inputs"].reshape(-1) for b in batches] + [batches[-1]["targets"][-1, -1:]])
    assert stream.astype(np.uint8).tobytes() == corpus.read_bytes()[: num_batches * BATCH * SEQ + 1]


@pytest.mark.parametrize("process_count", [2, 3])
def test_process_shards_are_disjoint_and_cover(small_text: pathlib.Path, process_count: int) -> None:
    """One epoch per process (batch 1): the windows of all processes, as a multiset, are
    exactly the file's windows; each is seen once, by one process. The next epoch is
    the same share reshuffled."""
    seq, num_windows = 8, 101
    data = np.frombuffer(small_text.read_bytes(), dtype=np.uint8).astype(np.int32)
    all_windows = sorted(tuple(data[i * seq : i * seq + seq + 1]) for i in range(num_windows))
    cfg = _cfg("text", small_text, seed=5)
    seen, shares = [], []
    for index in range(process_count):
        it = make_input(
            cfg, seq_len=seq, batch_size=1, vocab_size=VOCAB, process_index=index, process_count=process_count
        )
        share = len(range(index, num_windows, process_count))
        epochs = [
            [tuple(b["inputs"][0]) + (int(b["targets"][0, -1]),) for b in _take(it, share)] for _ in range(2)
        ]
        assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
        seen += epochs[0]
        shares.append(set(epochs[0]))
    assert sorted(seen) == all_windows
    assert all(not (shares[i] & shares[j]) for i in range(process_count) for j in range(i))


def test_synthetic_processes_differ() -> None:
    kw = {"seq_len": SEQ, "batch_size": BATCH, "vocab_size": VOCAB, "process_count": 2}
    first = [next(make_input(_cfg("synthetic"), process_index=i, **kw))["inputs"] for i in range(2)]
    assert not np.array_equal(first[0], first[1])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"path": "missing.txt"}, ["missing.txt", "set data.path"]),
        ({"path": "."}, ["data.path", "set data.path"]),
        ({"path": "short"}, ["needs at least 17 tokens"]),
        ({"vocab_size": 255}, ["vocab_size=255", "model.vocab_size >= 256"]),
        ({"batch_size": 0}, ["batch_size=0", "train.batch_size"]),
        ({"seq_len": 0}, ["seq_len=0", "train.seq_len"]),
        ({"process_index": 2, "process_count": 2}, ["process_index=2", "process_count=2"]),
        ({"process_index": -1}, ["process_index=-1"]),
    ],
)
def test_errors(tmp_path: pathlib.Path, small_text: pathlib.Path, kwargs: dict, words: list[str]) -> None:
    (tmp_path / "short").write_bytes(b"x" * 16)
    path = kwargs.pop("path", small_text)
    path = path if isinstance(path, pathlib.Path) else tmp_path / path
    args = {"seq_len": SEQ, "batch_size": BATCH, "vocab_size": VOCAB} | kwargs
    with pytest.raises(ConfigError) as info:
        make_input(_cfg("text", path), **args)
    for word in words:
        assert word in str(info.value)
