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
import os
from collections.abc import Callable, Iterable
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
    """Every tensor of the safetensors files in `directory` (one file, or shards + index). With
    `check_finite`, a read that holds a NaN or an infinity is a `ConfigError` naming the tensor and
    its file (an import: a damaged download or a diverged model would train on as NaN)."""

    def __init__(self, directory: str | Path, check_finite: bool = False):
        from safetensors import safe_open

        self.directory = Path(directory)
        self.check_finite = check_finite
        index = self.directory / INDEX
        if index.is_file():
            files = _indexed_files(index)
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(
                f"{self.directory} has no *.safetensors files beside its config.json; download the weights "
                "too (only safetensors are read: convert .bin / .pt files with transformers first)"
            )
        self._where: dict[str, object] = {}
        self._file: dict[str, Path] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise ConfigError(f"{path} is missing (named by {index.name}); download it again")
            try:
                handle = safe_open(str(path), framework="np")
            except Exception as e:  # SafetensorError (a truncated or garbled header), OSError
                raise _unreadable(path, e) from None
            for key in handle.keys():
                self._where[key], self._file[key] = handle, path

    def file_of(self, key: str) -> Path:
        return self._file[key]

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
            array = np.asarray(part[index] if index else part[:])
        except Exception as e:  # the data behind a valid header is cut short or garbled
            raise _unreadable(self._file[key], e, key) from None
        if self.check_finite:
            _check_finite(array, key, self._file[key])
        return array


def _check_finite(array: np.ndarray, key: str, path: Path) -> None:
    if array.dtype.kind in "biu":
        return
    bad = ~np.isfinite(array)  # float16/32/64 and ml_dtypes' bfloat16 / float8 alike
    if bad.any():
        nan = int(np.isnan(array).sum())
        raise ConfigError(
            f"tensor {key!r} of {path} holds {nan} NaN and {int(bad.sum()) - nan} infinite values (in the part "
            "read): the file is damaged or the model diverged; download it again, or pass --allow-nonfinite "
            "to import it as it is"
        )


def _indexed_files(index: Path) -> list[str]:
    """The shard names `model.safetensors.index.json` maps tensors to (a damaged index named)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON, missing map, wrong kinds
        reason = "no 'weight_map'" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ConfigError(
            f"{index} cannot be read ({reason}); the index is damaged: download it again"
        ) from None
    if not all(isinstance(f, str) and f and "/" not in f for f in files):
        raise ConfigError(f"{index}: 'weight_map' must map each tensor to a file name beside it")
    return files


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _to_file(tensors: dict[str, np.ndarray], path: Path) -> None:
    """One safetensors file, readable as the user's umask says (safetensors itself writes 0600, so a
    shared model folder was unreadable to the group; `save_pretrained` follows the umask)."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def write_sharded(
    tensors: Iterable[tuple[str, np.ndarray]],
    directory: str | Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    report: Callable[[str], None] | None = None,
) -> list[str]:
    """Writes (name, array) pairs into `model.safetensors`, or into numbered shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) plus the index; returns file names.
    Only one shard's tensors are held in memory at a time; `report` gets a line per file."""
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
            if report is not None:
                report(f"wrote file {len(shards)}: {len(pending)} tensors, {size / 1e6:,.1f} MB")
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
