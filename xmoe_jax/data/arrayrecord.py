"""Pre-tokenized ArrayRecord shards: the layout `xmoe-tokenize` writes and the trainer reads.

Why this layout: ArrayRecord gives random access to records, which grain needs for an exact,
index-based resume. One record is one document's token ids (little-endian, `dtype` of the
manifest) ending with the tokenizer's end-of-document id; a `.lengths.npy` beside each shard holds
its records' token counts, so a window of the concatenated stream is found by binary search
without reading the shards at start-up.

A dataset directory:
  manifest.json                 {"format": "xmoe-tokens", "version": 1, tokenizer, vocab_size,
                                 eos_id, dtype, text_field, inputs, shards: [{file, lengths,
                                 documents, tokens, next_input, next_document}], complete}
  shard-00000.array_record      records = documents
  shard-00000.lengths.npy       int64 [records]
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any

import grain
import numpy as np

from xmoe_jax import storage
from xmoe_jax.config import ConfigError

MANIFEST = "manifest.json"
FORMAT = "xmoe-tokens"
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random reads touch only what they need


def is_arrayrecord_dir(path: str) -> bool:
    """Whether `path` is an xmoe-tokenize output. One whose manifest is damaged is a `ConfigError`
    naming the manifest (not a folder of documents that holds no documents)."""
    directory = pathlib.Path(path)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return _parse(manifest).get("format") == FORMAT
    except ConfigError:
        try:
            text = manifest.read_text(errors="replace")
        except OSError:
            text = FORMAT  # unreadable: say so rather than guess whose it is
        if FORMAT in text or any(directory.glob("shard-*.array_record")):
            raise
        return False  # another program's manifest.json beside documents


def _parse(path: pathlib.Path) -> dict[str, Any]:
    fix = f"restore it, or delete {path.parent} and run the xmoe-tokenize command again"
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is damaged ({e.msg}: line {e.lineno} column {e.colno}); {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e}); {fix}") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path} is damaged (a JSON {type(manifest).__name__}, not an object); {fix}")
    return manifest


def read_manifest(directory: pathlib.Path) -> dict[str, Any] | None:
    """The manifest of an xmoe-tokenize output, None if it has none; `ConfigError` naming the file
    and the damage if it cannot be read."""
    path = directory / MANIFEST
    return _parse(path) if path.is_file() else None


def write_manifest(directory: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Atomic: a reader (or a resumed job) sees the old or the new manifest, never half of one
    (`storage.WriteError` naming it if it cannot be written)."""
    with storage.replacing(directory / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


class ShardWriter:
    """One shard, written to `<file>.tmp` and renamed on `commit`, so a shard either exists whole
    or not at all. A write that fails (a full disk) raises `storage.WriteError` naming the shard;
    `abort` then removes the unfinished file."""

    def __init__(self, directory: pathlib.Path, index: int, dtype: np.dtype) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        self.name = f"shard-{index:05d}.array_record"
        self._path = directory / self.name
        self._tmp = directory / (self.name + ".tmp")
        with storage.writing(self._path):
            self._writer = ArrayRecordWriter(str(self._tmp), WRITER_OPTIONS)
        self._dtype = dtype
        self.lengths: list[int] = []
        self.tokens = 0

    def write(self, tokens: np.ndarray) -> None:
        with storage.writing(self._path):
            self._writer.write(np.asarray(tokens, dtype=self._dtype).tobytes())
        self.lengths.append(len(tokens))
        self.tokens += len(tokens)

    def commit(self) -> dict[str, Any]:
        with storage.writing(self._path):
            self._writer.close()
        lengths = self._path.with_suffix(".lengths.npy")
        with storage.replacing(lengths) as tmp, tmp.open("wb") as f:
            np.save(f, np.asarray(self.lengths, dtype=np.int64))
        with storage.writing(self._path):
            os.replace(self._tmp, self._path)
        return {
            "file": self.name,
            "lengths": lengths.name,
            "documents": len(self.lengths),
            "tokens": self.tokens,
        }

    def abort(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # the write that failed fails again here
            self._writer.close()
        self._tmp.unlink(missing_ok=True)


def _checked_shards(manifest: dict[str, Any], directory: pathlib.Path) -> list[dict[str, Any]]:
    """The manifest's shard entries, each with its files there; `ConfigError` naming what is wrong."""
    fix = f"delete {directory} and run the xmoe-tokenize command again"
    shards = manifest.get("shards")
    keys = ("file", "lengths", "tokens")
    if not isinstance(shards, list) or not all(
        isinstance(s, dict) and all(k in s for k in keys) for s in shards
    ):
        raise ConfigError(f"{directory / MANIFEST} is damaged (its 'shards' are not a list of {keys}); {fix}")
    for s in shards:
        for name in (s["file"], s["lengths"]):
            if not (directory / name).is_file():
                raise ConfigError(f"{directory / name}, listed in {directory / MANIFEST}, is missing; {fix}")
    return shards


class ArrayRecordStream:
    """The documents of every shard, concatenated, as one token stream."""

    def __init__(self, path: str, prefix: str = "data.") -> None:
        directory = pathlib.Path(path)
        where = f"{prefix}path={path!r}"
        manifest = read_manifest(directory) if directory.is_dir() else None
        if manifest is None or manifest.get("format") != FORMAT:
            raise ConfigError(f"{where} is not a directory written by xmoe-tokenize (no {MANIFEST})")
        if not manifest.get("complete"):
            raise ConfigError(
                f"{where} is an unfinished xmoe-tokenize output; rerun the same xmoe-tokenize command to finish it"
            )
        shards = _checked_shards(manifest, directory)
        if not shards or sum(s["tokens"] for s in shards) == 0:
            raise ConfigError(f"{where} holds no tokens; tokenize a non-empty corpus")
        self.manifest = manifest
        self.vocab_size = int(manifest["vocab_size"])
        self._dtype = np.dtype(manifest["dtype"])
        self._source = grain.sources.ArrayRecordDataSource([str(directory / s["file"]) for s in shards])
        lengths = np.concatenate([np.load(directory / s["lengths"]) for s in shards])
        if len(lengths) != len(self._source):
            raise ConfigError(
                f"{where}: the shards hold {len(self._source)} records, the index {len(lengths)}"
            )
        self._ends = np.cumsum(lengths)  # record r covers tokens [ends[r] - lengths[r], ends[r])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        first = int(np.searchsorted(self._ends, start, side="right"))
        last = int(np.searchsorted(self._ends, stop - 1, side="right"))
        records = self._source.__getitems__(list(range(first, last + 1)))
        tokens = np.concatenate([np.frombuffer(r, dtype=self._dtype) for r in records])
        offset = start - (int(self._ends[first - 1]) if first else 0)
        return tokens[offset : offset + stop - start].astype(np.int32)
