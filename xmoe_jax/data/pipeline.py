"""Grain input pipeline: an infinite, resumable stream of next-token batches, and the fixed
evaluation batches.

Why grain's `MapDataset`: every stage (source, slice, shuffle, repeat, mix, batch) is
random-access, so an iterator's whole position is one integer. `get_state()` /
`set_state()` resume a run exactly, and `grain.checkpoint.CheckpointSave(it)` /
`CheckpointRestore(it)` store that state next to the model in an orbax checkpoint.

Training pipeline (`make_input`):
  1. per source of `data.sources` (one, or the mixture): windows of `seq_len + 1` tokens
     (`sources.open_windows`: tokenized, packed with end-of-document ids, checked);
  2. hold out the last `eval.holdout` fraction of each source's windows for evaluation;
  3. per-process slice `[process_index::process_count]`, taken BEFORE shuffling,
     so each process owns a fixed, disjoint share and every epoch covers it;
  4. shuffle with `data.seed` (+ the source's position in the mixture) if `data.shuffle`;
     `repeat()` reshuffles each epoch (grain reseeds its shuffle with seed + epoch);
  5. mix the sources by weight (grain's deterministic, index-based mixture);
  6. split each window into inputs / targets (targets = inputs shifted by one);
  7. batch the per-process `batch_size` sequences; batches cross epoch edges.

Evaluation (`make_eval_input`): the held-out windows (or `eval.data`), unshuffled, sliced per
process, mixed by the same weights, batched; element i is the i-th batch of every evaluation, so
eval losses compare over a run.

Shapes: B = per-process batch, S = seq_len, W = S + 1 window.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import grain
import numpy as np

from xmoe_jax.config import Config, ConfigError, DataConfig, SourceConfig
from xmoe_jax.data.sources import open_windows
from xmoe_jax.data.windows import PackedWindows

log = logging.getLogger("xmoe_jax")
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass
class _Part:
    """One source's windows, split into training and held-out parts."""

    train: grain.MapDataset
    held_out: grain.MapDataset | None
    weight: float
    seed: int
    about: str = ""  # for the start-up summary: the source and its size


def _check_sizes(
    seq_len: int, batch_size: int, vocab_size: int, process_index: int, process_count: int
) -> None:
    _check(batch_size >= 1, f"batch_size={batch_size} (per process) must be >= 1; raise train.batch_size")
    _check(seq_len >= 1, f"seq_len={seq_len} must be >= 1; set train.seq_len")
    _check(vocab_size >= 1, f"vocab_size={vocab_size} must be >= 1; set model.vocab_size")
    _check(process_count >= 1, f"process_count={process_count} must be >= 1")
    _check(
        0 <= process_index < process_count,
        f"process_index={process_index} must be in [0, process_count={process_count})",
    )


def _open_part(
    src: SourceConfig,
    prefix: str,
    tokenizer: str,
    seed: int,
    holdout: float,
    seq_len: int,
    vocab: int,
    pc: int,
) -> _Part:
    windows = open_windows(src, tokenizer, seq_len=seq_len, vocab_size=vocab, seed=seed, prefix=prefix)
    num = len(windows)
    num_held = math.ceil(holdout * num) if holdout else 0
    where = f"{prefix}path={src.path!r}"
    if isinstance(windows, PackedWindows) and num - num_held < pc:
        held = f" after holding out eval.holdout={holdout} of it" if num_held else ""
        raise ConfigError(
            f"{where} has {len(windows.stream)} tokens{held}, but seq_len={seq_len} with {pc} process(es) needs "
            f"at least {pc * seq_len + 1} tokens for training; use more data or a smaller seq_len"
        )
    if num_held:
        _check(
            num_held >= pc,
            f"{where}: eval.holdout={holdout} keeps {num_held} window(s) of seq_len + 1 tokens for evaluation, "
            f"fewer than the {pc} process(es); raise eval.holdout or use more data",
        )
    ds = grain.MapDataset.source(windows)
    if isinstance(windows, PackedWindows):
        held = f", {num_held:,} held out for eval" if num_held else ""
        about = (
            f"{where}: {len(windows.stream):,} tokens, {num - num_held:,} windows of seq_len={seq_len}{held}"
        )
    else:
        about = f"{prefix}source=synthetic (generated, no files)"
    return _Part(
        ds[: num - num_held] if num_held else ds,
        ds[num - num_held :] if num_held else None,
        src.weight,
        seed,
        about,
    )


def _parts(
    data_cfg: DataConfig, holdout: float, seq_len: int, vocab_size: int, process_count: int
) -> list[_Part]:
    sources = data_cfg.sources
    prefixes = ["data."] if not data_cfg.mixture else [f"data.mixture[{k}]." for k in range(len(sources))]
    seeds = [(data_cfg.seed + k) % 2**32 for k in range(len(sources))]  # grain shuffle seeds are uint32
    return [
        _open_part(
            src, prefixes[k], data_cfg.tokenizer, seeds[k], holdout, seq_len, vocab_size, process_count
        )
        for k, src in enumerate(sources)
    ]


def _mix(datasets: list[grain.MapDataset], weights: list[float]) -> grain.MapDataset:
    return datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, weights)


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
    holdout: float = 0.0,
) -> grain.DatasetIterator:
    """Infinite iterator of {"inputs", "targets"}: np.int32 [batch_size, seq_len].

    `batch_size` is per process; `holdout` (eval.holdout) leaves the last fraction of every source
    out. The stream is a pure function of the arguments; resume it with `it.set_state(saved)` or
    orbax `grain.checkpoint.CheckpointRestore(it)`. Raises `ConfigError` for bad sizes, a bad
    process index, a tokenizer that does not fit the model or unusable data.
    """
    _check_sizes(seq_len, batch_size, vocab_size, process_index, process_count)
    parts = _parts(data_cfg, holdout, seq_len, vocab_size, process_count)
    log.info("data: %s", "; ".join(part.about for part in parts))
    streams = []
    for part in parts:
        ds = part.train[process_index::process_count]
        if data_cfg.shuffle:
            ds = ds.shuffle(seed=part.seed)
        streams.append(ds.repeat())
    ds = _mix(streams, [p.weight for p in parts]).map(_split).batch(batch_size, drop_remainder=True)
    return iter(ds.to_iter_dataset(_READ_OPTIONS))


def make_eval_input(
    cfg: Config, *, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset | None:
    """The `eval.steps` evaluation batches (random access: element i is batch i, [B, S] inputs and
    targets per process), or None when the config has no eval data (no holdout, no eval.data)."""
    ev = cfg.eval
    if not ev.has_data:
        return None
    seq_len, vocab = cfg.train.seq_len, cfg.model.vocab_size
    batch_size = cfg.train.batch_size // process_count
    _check_sizes(seq_len, batch_size, vocab, process_index, process_count)
    if ev.data is not None:
        seed = cfg.data.seed % 2**32
        parts = [
            _open_part(ev.data, "eval.data.", cfg.data.tokenizer, seed, 0.0, seq_len, vocab, process_count)
        ]
        held = [p.train for p in parts]
    else:
        parts = _parts(cfg.data, ev.holdout, seq_len, vocab, process_count)
        held = [p.held_out for p in parts]
    shares = [ds[process_index::process_count] for ds in held]
    available, needed = sum(len(s) for s in shares), ev.steps * batch_size
    if available < needed:
        log.warning(
            "eval data has %d windows per process, fewer than eval.steps * batch = %d: some are evaluated "
            "more than once; lower eval.steps or hold out more",
            available,
            needed,
        )
    ds = _mix([s.repeat() for s in shares], [p.weight for p in parts])
    return ds.map(_split).batch(batch_size, drop_remainder=True)[: ev.steps]
