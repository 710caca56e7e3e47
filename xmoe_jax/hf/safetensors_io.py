"""Safetensors in and out, a tensor (or a slice of one) at a time, without torch.

Why: a HuggingFace checkpoint can be larger than one device or one host's spare memory.
`Reader` opens every shard of a directory lazily (`safetensors.safe_open(..., "np")`,
memory-mapped) and hands out single tensors or slices of them, so an import reads only
what each device's shard of each parameter needs. `write_sharded` writes tensors as
they come, cutting a new file when one reaches the size limit, with the
`model.safetensors.index.json` that `transformers` reads when there are several.
bfloat16 tensors are numpy arrays of `ml_dtypes.bfloat16` (a jax dependency).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from xmoe_jax.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default shard size


def _unreadable(path: Path, e: Exception, key: str | None = None) -> ConfigError:
    reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    what = f"tensor {key!r} of {path}" if key else str(path)
    return ConfigError(
        f"{what} cannot be read ({type(e).__name__}: {reason}): the file is truncated or damaged; "
        "download it again"
    )


class Reader:
    """Every tensor of the safetensors files in `directory` (one file, or shards + index)."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self._where: dict[str, object] = {}
        self._file: dict[str, Path] = {}
        for name in files:
            path = self.directory / name
            try:
                handle = safe_open(str(path), framework="np")
            except Exception as e:  # SafetensorError (a truncated or garbled header), OSError
                raise _unreadable(path, e) from None
            for key in handle.keys():
                self._where[key], self._file[key] = handle, path

    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())

    def read(self, key: str, index: tuple = ()) -> np.ndarray:
        """The tensor `key`, or only `index` (a tuple of ints / slices) of it."""
        try:
            part = self._where[key].get_slice(key)
            return np.asarray(part[index] if index else part[:])
        except Exception as e:  # the data behind a valid header is cut short or garbled
            raise _unreadable(self._file[key], e, key) from None


def _to_file(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_sharded(
    tensors: Iterable[tuple[str, np.ndarray]],
    directory: str | Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Writes (name, array) pairs into `model.safetensors`, or into numbered shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) plus the index; returns file names.
    Only one shard's tensors are held in memory at a time."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, str]] = []  # per shard: tensor name -> temporary file name
    pending: dict[str, np.ndarray] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            tmp = f"shard-{len(shards):05d}.tmp"
            _to_file(pending, directory / tmp)
            shards.append(dict.fromkeys(pending, tmp))
            pending, size = {}, 0

    for name, array in tensors:
        if pending and size + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        size += array.nbytes
        total += array.nbytes
    flush()
    if len(shards) == 1:
        (directory / next(iter(shards[0].values()))).rename(directory / SINGLE)
        return [SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / next(iter(shard.values()))).rename(directory / name)
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return names
