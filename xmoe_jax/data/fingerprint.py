"""What a data position indexes into: cheap fingerprints of the training data and of documents.

Why: the data position a checkpoint saves is an index into one stream of windows. Resumed on
other data (re-tokenized shards, a much smaller corpus, a reordered `.jsonl`) the same index
points at other text, and the run would go on with exit 0. So:
  1. every checkpoint records the fingerprint of its data (`of_data`) in its integrity manifest
     (`train/integrity.py`, key `data_fingerprint`), set by the loop on its `Checkpointer`;
  2. `--resume` compares it with the data it is given (`check_resume`, before anything compiles):
     a change is refused with one line naming what changed and `--new-data`, the flag that
     accepts it; with that flag the model and optimizer resume and the data starts at position 0
     of the new data. A checkpoint without a fingerprint (an older xmoe_jax, `xmoe-convert
     import`) resumes as before, and the log says so;
  3. `xmoe-tokenize` records the same per-file fingerprints of its inputs (`files_table`) in its
     manifest, so a resumed job refuses inputs edited in between (`changed_file`).

Fingerprint of one source (`of_source`); cheap by design, it never reads a whole corpus:
  arrayrecord  sha256 of its manifest.json (shards with their documents and tokens, tokenizer,
               and the inputs' fingerprints), less the input paths as typed (a corpus tokenized
               again from another folder is the same data);
  megatron, text, files, hf
               per file: its size and a sha256 of its first and last `EDGE_BYTES`, by its name
               relative to the source's folder (a moved corpus matches), plus `text_field` and
               `split` where they pick the text;
  synthetic    nothing: the stream is a function of the config.
Limits: an edit that keeps a file's size and touches neither its head nor its tail goes unseen.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import pathlib
from typing import Any

from xmoe_jax.config import ConfigError, DataConfig, SourceConfig
from xmoe_jax.data import documents, megatron, sources
from xmoe_jax.data.arrayrecord import read_manifest

log = logging.getLogger("xmoe_jax")

VERSION = 1
EDGE_BYTES = 1 << 16  # hashed at each end of a file
MAX_NAMED = 1000  # files listed by name (to say which changed); larger sources keep totals only
ACCEPT_FLAG = "--new-data"
MANIFEST_KEY = "data_fingerprint"  # in a checkpoint's integrity manifest


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_print(path: pathlib.Path) -> list:
    """[size, sha256 of the first and last EDGE_BYTES (16 hex digits)]."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
    return [size, h.hexdigest()[:16]]


def root_of(path: str) -> pathlib.Path:
    """The folder names are relative to: a folder itself, a file's folder, a glob's fixed part."""
    if documents.is_glob(path):
        fixed = []
        for part in pathlib.Path(path).parts:
            if documents.is_glob(part):
                break
            fixed.append(part)
        return pathlib.Path(*fixed) if fixed else pathlib.Path(".")
    p = pathlib.Path(path)
    return p if p.is_dir() else p.parent


def files_table(files: list[pathlib.Path], root: pathlib.Path) -> dict[str, list]:
    """Name relative to `root` -> `file_print`, for every file."""
    base = root.absolute()
    table = {}
    for f in files:
        try:
            name = f.absolute().relative_to(base).as_posix()
        except ValueError:
            name = str(f)
        table[name] = file_print(f)
    return table


def _files_of(kind: str, src: SourceConfig, prefix: str) -> list[pathlib.Path]:
    if kind == "megatron":
        return list(megatron.files_of(src.path))
    if kind == "files":
        return documents.list_files(src.path, prefix)
    if kind == "text":
        return [pathlib.Path(src.path)]
    root = pathlib.Path(src.path)  # hf: a datasets folder, or .arrow files
    if root.is_dir():
        return sorted(f for f in root.rglob("*") if f.is_file())
    return sorted(pathlib.Path(p) for p in glob.glob(src.path) if pathlib.Path(p).is_file())


def of_source(src: SourceConfig, prefix: str) -> dict:
    """The fingerprint of one source (see the module docstring)."""
    kind = sources.detect_kind(src, prefix)
    where = f"{prefix}path={src.path!r}"
    if kind == "synthetic":
        return {"kind": kind, "where": f"{prefix}source=synthetic", "digest": ""}
    if kind == "arrayrecord":
        manifest = read_manifest(pathlib.Path(src.path)) or {}
        shards = manifest.get("shards") or []
        return {
            "kind": kind,
            "where": where,
            "digest": _digest({k: v for k, v in manifest.items() if k != "inputs"}),
            "shards": len(shards),
            "tokens": sum(int(s.get("tokens", 0)) for s in shards),
        }
    table = files_table(_files_of(kind, src, prefix), root_of(src.path))
    picks = {"text_field": src.text_field} if kind in ("files", "hf") else {}
    picks |= {"split": src.split} if kind == "hf" else {}
    out = {
        "kind": kind,
        "where": where,
        "digest": _digest([table, picks]),
        "num_files": len(table),
        "bytes": sum(size for size, _ in table.values()),
        **picks,
    }
    return out | ({"files": table} if len(table) <= MAX_NAMED else {})


def of_data(data_cfg: DataConfig) -> dict:
    """The fingerprint of the training data (every source of the mixture, in order)."""
    prefixes = (
        ["data."] if not data_cfg.mixture else [f"data.mixture[{k}]." for k in range(len(data_cfg.sources))]
    )
    return {
        "version": VERSION,
        "sources": [of_source(s, p) for s, p in zip(data_cfg.sources, prefixes, strict=True)],
    }


# ----------------------------------------------------------------------------- what changed


def changed_file(was: dict[str, list], now: dict[str, list]) -> str | None:
    """The first file that differs between two `files_table`s, in words; None if they match."""
    for name in sorted(was.keys() | now.keys()):
        a, b = was.get(name), now.get(name)
        if a == b:
            continue
        if a is None:
            return f"{name} is new"
        if b is None:
            return f"{name} is gone"
        if a[0] != b[0]:
            return f"{name} is {b[0]:,} bytes, was {a[0]:,}"
        return f"{name} has other content at the same size (edited or reordered)"
    return None


def _source_change(was: dict, now: dict) -> str | None:
    if was.get("kind") != now["kind"]:
        return f"{now['where']} is {now['kind']} data, the checkpoint's was {was.get('kind')} ({was.get('where')})"
    if was.get("digest") == now["digest"]:
        return None
    where = now["where"]
    if now["kind"] == "arrayrecord":
        sizes = f"{now['shards']} shard(s), {now['tokens']:,} tokens, was {was.get('shards')}, {was.get('tokens', 0):,}"
        return f"{where}: its manifest.json differs (tokenized again or other shards: {sizes})"
    for pick in ("text_field", "split"):
        if was.get(pick) != now.get(pick):
            return f"{where}: {pick} is {now.get(pick)!r}, was {was.get(pick)!r}"
    if "files" in was and "files" in now:
        what = changed_file(was["files"], now["files"])
        if what:
            return f"{where}: {what}"
    return (
        f"{where}: its {now['num_files']} file(s) of {now['bytes']:,} bytes differ from the "
        f"{was.get('num_files')} of {was.get('bytes', 0):,} bytes it was"
    )


def describe_change(saved: dict, now: dict) -> str | None:
    """What differs between two `of_data` fingerprints, in one phrase; None if nothing does."""
    old, new = saved.get("sources") or [], now["sources"]
    if len(old) != len(new):
        return f"the data has {len(new)} source(s), the checkpoint's had {len(old)}"
    for was, cur in zip(old, new, strict=True):
        what = _source_change(was, cur)
        if what:
            return what
    return None


# ----------------------------------------------------------------------------- resume


def saved(checkpoints: pathlib.Path, step: int) -> dict | None:
    """The fingerprint checkpoint `step` recorded, None if it has none. Read from the manifest's
    file directly, as `Checkpointer._quick_check` does (every process may read it)."""
    try:
        manifest = json.loads((checkpoints / str(step) / "manifest" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get(MANIFEST_KEY) if isinstance(manifest, dict) else None


def check_resume(checkpoints: pathlib.Path, step: int, now: dict, new_data: bool) -> bool:
    """Whether the data position saved at `step` applies to the data `now` (`of_data`).

    True: same data (or a checkpoint without a fingerprint: the position is used unchecked).
    False: the data changed and `new_data` (`--new-data`) accepts it: start at position 0.
    `ConfigError` naming what changed and the flag when the data changed and `new_data` is off.
    """
    was = saved(checkpoints, step)
    if was is None:
        if new_data:
            log.info(
                "%s: the data starts at position 0 (checkpoint step %d records no fingerprint)",
                ACCEPT_FLAG,
                step,
            )
            return False
        log.info(
            "checkpoint step %d in %s records no data fingerprint (an older xmoe_jax or xmoe-convert import "
            "wrote it): resuming at its data position without checking the data",
            step,
            checkpoints,
        )
        return True
    what = describe_change(was, now)
    if what is None:
        if new_data:
            log.warning(
                "%s: the data has not changed since checkpoint step %d; resuming at its position",
                ACCEPT_FLAG,
                step,
            )
        return True
    if not new_data:
        raise ConfigError(
            f"--resume: the data changed since checkpoint step {step} in {checkpoints}: {what}. Its data "
            f"position indexes into the old data; resume on that data, or pass {ACCEPT_FLAG} to train on "
            "this data from its start (position 0) with the resumed model"
        )
    log.warning(
        "%s: %s; the model and optimizer resume from step %d, the data starts at position 0",
        ACCEPT_FLAG,
        what,
        step,
    )
    return False
