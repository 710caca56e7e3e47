"""Megatron indexed datasets (`prefix.bin` + `prefix.idx`): the format X-MoE, Megatron-LM and
Megatron-DeepSpeed train from, read with numpy memory maps.

Why the whole .bin is one token stream: its sequences are stored back to back in order (the
pointers are cumulative), and Megatron's GPT dataset concatenates them the same way, relying on
the end-of-document token its preprocessing appends (`--append-eod`). We add nothing.

`.idx` layout (little-endian), as Megatron's `_IndexWriter` writes it:
  magic b"MMIDIDX\\x00\\x00" | version u64 (=1) | dtype code u8 | sequence count u64 |
  document count u64 | sizes int32[sequences] | pointers int64[sequences] (byte offsets into
  .bin) | document indices int64[documents] (sequence index where each document starts, then the
  total: documents + 1 entries).
"""

from __future__ import annotations

import pathlib
import struct

import numpy as np

from xmoe_jax.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_TOKEN_CODES = (1, 3, 4, 5, 8)  # integer dtypes that can hold token ids


def files_of(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(.idx, .bin) of `data/x_text_document`, its `.bin` or its `.idx` (prefixes may hold dots)."""
    base = str(path)
    base = base[:-4] if base.endswith((".bin", ".idx")) else base
    return pathlib.Path(base + ".idx"), pathlib.Path(base + ".bin")


def is_megatron(path: str) -> bool:
    return files_of(path)[0].is_file()


def write_megatron(prefix: str | pathlib.Path, documents: list[np.ndarray], dtype=np.uint16) -> None:
    """Writes `prefix.bin` / `prefix.idx`, one sequence per document (Megatron's GPT layout)."""
    idx, binf = files_of(prefix)
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1] * itemsize]).astype(np.int64)
    with binf.open("wb") as f:
        for doc in documents:
            f.write(np.asarray(doc, dtype=dtype).tobytes())
    doc_idx = np.arange(len(documents) + 1, dtype=np.int64)
    with idx.open("wb") as f:
        f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", _CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes() + pointers[: len(sizes)].tobytes() + doc_idx.tobytes())


class MegatronIndex:
    """The parsed .idx and the memory-mapped .bin; `tokens_N` is the whole token stream."""

    def __init__(self, path: str, prefix: str = "data.") -> None:
        idx, binf = files_of(path)
        where = f"{prefix}path={path!r}"
        for f in (idx, binf):
            if not f.is_file():
                raise ConfigError(f"{where}: {f} is missing; a Megatron dataset is a .bin and .idx pair")
        with idx.open("rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[: len(MAGIC)] != MAGIC:
            raise ConfigError(f"{where}: {idx} is not a Megatron index (no MMIDIDX header)")
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", head[len(MAGIC) :])
        if version != VERSION or code not in _TOKEN_CODES:
            raise ConfigError(
                f"{where}: {idx} has version {version} / dtype code {code}; expected 1 / integer ids"
            )
        self.dtype = np.dtype(DTYPES[code])
        offset = len(head)
        self.sizes = (
            np.memmap(idx, np.int32, "r", offset=offset, shape=(num_seqs,)) if num_seqs else np.zeros(0)
        )
        offset += 4 * num_seqs
        self.pointers = (
            np.memmap(idx, np.int64, "r", offset=offset, shape=(num_seqs,)) if num_seqs else np.zeros(0)
        )
        self.num_documents = max(0, num_docs - 1)
        num_tokens = int(np.sum(self.sizes, dtype=np.int64))
        if binf.stat().st_size != num_tokens * self.dtype.itemsize:
            raise ConfigError(
                f"{where}: {binf} holds {binf.stat().st_size} bytes but the index describes {num_tokens} "
                f"{self.dtype} tokens; the pair does not match"
            )
        if num_tokens == 0:
            raise ConfigError(f"{where} holds no tokens; point it at a non-empty dataset")
        self.tokens_N = np.memmap(binf, self.dtype, "r")
