"""Grain input pipeline: an infinite, resumable stream of next-token batches.

Why grain's `MapDataset`: every stage (source, shuffle, repeat, slice, batch) is
random-access, so an iterator's whole position is one integer. `get_state()` /
`set_state()` resume a run exactly, and `grain.checkpoint.CheckpointSave(it)` /
`CheckpointRestore(it)` store that state next to the model in an orbax checkpoint.

Pipeline (`make_input`):
  1. source: windows of `seq_len + 1` tokens (`synthetic` or byte-level `text`);
  2. per-process slice `[process_index::process_count]`, taken BEFORE shuffling,
     so each process owns a fixed, disjoint share and every epoch covers it;
  3. shuffle with `data.seed` (if `data.shuffle`); `repeat()` reshuffles each
     epoch (grain reseeds its shuffle with seed + epoch);
  4. split each window into inputs / targets (targets = inputs shifted by one);
  5. batch the per-process `batch_size` sequences; batches cross epoch edges.

Shapes: B = per-process batch, S = seq_len, W = S + 1 window, N = file bytes.
"""

from __future__ import annotations

import pathlib

import grain
import numpy as np

from xmoe_jax.config import ConfigError, DataConfig

TEXT_VOCAB = 256  # byte-level ids 0..255
SYNTHETIC_STRIDES = (1, 2, 3, 5)  # small set: the stride is inferable from two tokens
SYNTHETIC_EXAMPLES = 1 << 20  # one synthetic "epoch"; examples are made on demand
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class SyntheticWindows:
    """Arithmetic progressions mod `vocab_size`: tokens_W[t] = (start + stride * t) % V.

    Why this source: it is deterministic per (seed, index), needs no files, and is
    learnable in a few steps. A bigram already narrows the next token to
    len(SYNTHETIC_STRIDES) choices (loss log 4 instead of log V); a model that
    attends to the previous token can infer the stride and drive loss to ~0
    after the first position. `start` is uniform in [0, V).
    """

    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self._window = seq_len + 1
        self._vocab_size = vocab_size
        self._seed = seed

    def __len__(self) -> int:
        return SYNTHETIC_EXAMPLES

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self._seed, int(index)))
        start = int(rng.integers(self._vocab_size))
        stride = SYNTHETIC_STRIDES[int(rng.integers(len(SYNTHETIC_STRIDES)))]
        steps_W = np.arange(self._window, dtype=np.int64)
        return ((start + stride * steps_W) % self._vocab_size).astype(np.int32)


class TextWindows:
    """Byte-level windows of `seq_len + 1` tokens at stride `seq_len` over a file.

    Consecutive windows overlap by one byte, so every byte after the first is a
    target exactly once per epoch. The file is memory-mapped, never copied.
    """

    def __init__(self, path: pathlib.Path, seq_len: int) -> None:
        self._bytes_N = np.memmap(path, dtype=np.uint8, mode="r")
        self._seq_len = seq_len
        self._num_windows = (len(self._bytes_N) - 1) // seq_len

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(index) * self._seq_len
        return np.asarray(self._bytes_N[start : start + self._seq_len + 1], dtype=np.int32)


def _text_source(data_cfg: DataConfig, seq_len: int, vocab_size: int, process_count: int) -> TextWindows:
    """Validates the file (exists, readable, long enough) and wraps it."""
    _check(
        vocab_size >= TEXT_VOCAB,
        f"data.source='text' is byte-level ({TEXT_VOCAB} ids) but vocab_size={vocab_size}; "
        f"set model.vocab_size >= {TEXT_VOCAB}",
    )
    path = pathlib.Path(data_cfg.path or "")
    try:
        with path.open("rb"):
            pass
        num_bytes = path.stat().st_size
    except OSError as e:
        raise ConfigError(
            f"data.path={str(path)!r} cannot be read ({e.strerror}); set data.path to an existing text file"
        ) from e
    needed = process_count * seq_len + 1  # one window of seq_len + 1 bytes per process
    _check(
        num_bytes >= needed,
        f"data.path={str(path)!r} has {num_bytes} bytes but seq_len={seq_len} with "
        f"{process_count} process(es) needs at least {needed} bytes; use a longer file or a smaller seq_len",
    )
    return TextWindows(path, seq_len)


def _split(tokens_W: np.ndarray) -> dict[str, np.ndarray]:
    """Next-token pair: targets are the inputs shifted left by one."""
    return {"inputs": tokens_W[:-1], "targets": tokens_W[1:]}


def make_input(
    data_cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    vocab_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Infinite iterator of {"inputs", "targets"}: np.int32 [batch_size, seq_len].

    `batch_size` is per process. The stream is a pure function of (data_cfg,
    seq_len, batch_size, vocab_size, process_index, process_count); resume it with
    `it.set_state(saved)` or orbax `grain.checkpoint.CheckpointRestore(it)`.
    Raises `ConfigError` for bad sizes, a bad process index or an unusable file.
    """
    _check(batch_size >= 1, f"batch_size={batch_size} (per process) must be >= 1; raise train.batch_size")
    _check(seq_len >= 1, f"seq_len={seq_len} must be >= 1; set train.seq_len")
    _check(vocab_size >= 1, f"vocab_size={vocab_size} must be >= 1; set model.vocab_size")
    _check(process_count >= 1, f"process_count={process_count} must be >= 1")
    _check(
        0 <= process_index < process_count,
        f"process_index={process_index} must be in [0, process_count={process_count})",
    )
    seed = data_cfg.seed % 2**32  # grain shuffle seeds are uint32
    if data_cfg.source == "text":
        source = _text_source(data_cfg, seq_len, vocab_size, process_count)
    else:
        source = SyntheticWindows(seq_len, vocab_size, seed)

    ds = grain.MapDataset.source(source)[process_index::process_count]
    if data_cfg.shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat().map(_split).batch(batch_size, drop_remainder=True)
    return iter(ds.to_iter_dataset(_READ_OPTIONS))
