"""Checkpoint integrity: a manifest committed with every checkpoint, checked on resume.

What orbax guarantees (0.12, POSIX file systems): a step is written under
`<step>.orbax-checkpoint-tmp-<time>` and renamed to `<step>` only after every process has
finished writing, so a kill at any moment leaves either a complete step or a temporary folder
that orbax never lists as a step. What it does not: damage after the commit goes unseen (a
flipped bit in an array file reads back as another number; a truncated or deleted file may
fail, or read back as fill values). So every checkpoint also holds a `manifest` item, written
inside the same atomic commit:

    leaves   path -> shape, dtype and a 64-bit fingerprint of the values
    config   sha256 of the saved config
    data     sha256 of each process's data position
    data_fingerprint  what that position indexes into (`xmoe_jax/data/fingerprint.py`)
    run_state  the trainer's own state beside the arrays: the receive buffers' rung (`moe/ladder.py`)
    sha256   of the manifest's own content

Fingerprint of a leaf: two wrapping uint32 sums over its elements' bits (as unsigned ints),
each weighted by an odd function of the element's flat index. Integer sums are exact in any
order, so the figure is the same on any mesh and process count (a checkpoint resumes resharded)
and costs one pass over the state on device. A flipped bit b of one element changes the first
sum by 2^b * odd != 0 (mod 2^32): every single-bit flip is caught.

Temporary folders and steps that fail their checks are moved aside, never deleted, into
`<checkpoints>/rejected/` (`reject`), with a warning naming both paths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.errors import EXIT_BAD_INPUT, XmoeError

log = logging.getLogger("xmoe_jax")

MANIFEST_VERSION = 1
KEEP_REJECTED = 3  # set-aside checkpoints kept in rejected/ (the newest)
REJECTED_DIR = "rejected"
_TMP_MARK = ".orbax-checkpoint-tmp"
_W1, _W2, _C1, _C2 = 0x9E3779B1, 0x85EBCA77, 0x7F4A7C15, 0x165667B1


class IntegrityError(XmoeError):
    """A checkpoint step fails its integrity checks; the message names what differs. The checkpoint
    code turns it into a `DamagedCheckpointError`; should one escape, it is bad input too."""

    exit_code = EXIT_BAD_INPUT


# ----------------------------------------------------------------------------- fingerprints


def _as_u32(x: jax.Array) -> jax.Array:
    """The element bits as uint32 (wider dtypes get a trailing axis of uint32 words)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    if x.dtype.itemsize > 4:
        return jax.lax.bitcast_convert_type(bits, jnp.uint32)
    return bits.astype(jnp.uint32)


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    u = _as_u32(jnp.asarray(x))
    index = jnp.zeros(u.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(u.ndim)):  # the flat index, built without a reshape (no resharding)
        index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= u.shape[dim]
    w1 = (index * jnp.uint32(_W1) + jnp.uint32(_C1)) | jnp.uint32(1)
    w2 = ((index ^ jnp.uint32(_C2)) * jnp.uint32(_W2)) | jnp.uint32(1)
    rotated = (u << 13) | (u >> 19)
    return jnp.stack([jnp.sum(u * w1, dtype=jnp.uint32), jnp.sum(rotated * w2 + index, dtype=jnp.uint32)])


_fingerprint_tree = jax.jit(lambda tree: jax.tree.map(_leaf_fingerprint, tree))


def _key_str(entry: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_str(path: tuple) -> str:
    """Container-agnostic path: a NamedTuple field and the dict key orbax stores it under agree."""
    return "/".join(_key_str(e) for e in path) or "<root>"


def _dtype(x: Any) -> str:
    return str(jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x)))


def leaf_table(tree: Any) -> dict[str, dict]:
    """Path -> {"shape", "dtype", "fingerprint"} for every leaf of `tree` (one jitted pass)."""
    prints = jax.device_get(_fingerprint_tree(tree))
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    flat_prints = jax.tree_util.tree_leaves(prints)
    return {
        path_str(path): {
            "shape": list(np.shape(x)),
            "dtype": _dtype(x),
            "fingerprint": "{:08x}{:08x}".format(*(int(v) for v in fp)),
        }
        for (path, x), fp in zip(leaves, flat_prints, strict=True)
    }


# ----------------------------------------------------------------------------- the manifest


def digest(obj: Any) -> str:
    """sha256 of `obj` as canonical JSON (sorted keys, tuples as lists)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_manifest(
    step: int,
    state: Any,
    config: dict | None,
    data_digests: list[str] | None,
    data_print: dict | None = None,
    run_state: dict | None = None,
) -> dict:
    body = {
        "version": MANIFEST_VERSION,
        "step": int(step),
        "leaves": leaf_table(state),
        "config": digest(json.loads(json.dumps(config))) if config is not None else None,
        "data": data_digests,
    }
    if data_print is not None:  # what the data position indexes into (data/fingerprint.py)
        body["data_fingerprint"] = data_print
    if run_state is not None:  # the trainer's own state beside the arrays (the buffer ladder's rung)
        body["run_state"] = run_state
    return {**body, "sha256": digest(body)}


def check_manifest(manifest: Any, step: int) -> dict:
    """Raises `IntegrityError` unless `manifest` is well formed, unaltered and for `step`."""
    if not isinstance(manifest, dict) or "sha256" not in manifest:
        raise IntegrityError("its manifest is not a manifest")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if digest(body) != manifest["sha256"]:
        raise IntegrityError("its manifest does not match its own checksum")
    if body.get("step") != step:
        raise IntegrityError(f"its manifest is for step {body.get('step')}")
    return body


def check_config(manifest: dict, config: dict) -> None:
    if manifest.get("config") is not None and digest(config) != manifest["config"]:
        raise IntegrityError("its saved config differs from the one its manifest recorded")


def check_data(manifest: dict, data_state: Any, process_index: int) -> None:
    saved = manifest.get("data")
    if saved and process_index < len(saved) and digest(data_state) != saved[process_index]:
        raise IntegrityError(
            f"the data position of process {process_index} differs from the one its manifest recorded"
        )


def check_state(manifest: dict, state: Any, partial: bool = False) -> None:
    """Compares the restored `state` with the manifest, leaf by leaf (`partial`: only the leaves
    under the top-level entries that were restored, e.g. the weights without the optimizer)."""
    recorded = manifest["leaves"]
    restored = leaf_table(state)
    if partial:
        named = {p.split("/", 1)[0] for p in restored}
        recorded = {p: v for p, v in recorded.items() if p.split("/", 1)[0] in named}
    for path, want in recorded.items():
        got = restored.get(path)
        if got is None:
            raise IntegrityError(f"leaf '{path}' is missing")
        if got != want:
            what = (
                "fingerprint" if got["shape"] == want["shape"] and got["dtype"] == want["dtype"] else "layout"
            )
            raise IntegrityError(
                f"leaf '{path}' has another {what} than its manifest recorded (damaged data)"
            )


# ----------------------------------------------------------------------------- the folder


def partial_saves(directory: Path) -> list[Path]:
    """Temporary folders of saves that never completed (a kill during the save)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _TMP_MARK in p.name and p.is_dir())


def tmp_step(path: Path) -> int | None:
    m = re.match(r"(\d+)\.orbax-checkpoint-tmp", path.name)
    return int(m.group(1)) if m else None


def reject(directory: Path, name: str, reason: str) -> Path:
    """Moves `directory/name` to `directory/rejected/` (a free name), logging both paths; keeps only
    the newest `KEEP_REJECTED` there (each interrupted save of a big model costs its full size)."""
    dest_dir = directory / REJECTED_DIR
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / name
    n = 1
    while dest.exists():
        dest, n = dest_dir / f"{name}.{n}", n + 1
    shutil.move(str(directory / name), str(dest))
    os.utime(dest)  # the time it was set aside: what "newest" means below
    log.warning(
        "checkpoint %s %s; moved to %s (the newest %d set aside are kept; delete them when you no "
        "longer need them)",
        directory / name,
        reason,
        dest,
        KEEP_REJECTED,
    )
    entries = sorted(dest_dir.iterdir(), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    for old in entries[KEEP_REJECTED:]:
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
        log.warning("deleted %s: only the newest %d set-aside checkpoints are kept", old, KEEP_REJECTED)
    return dest
