"""The folder an export goes to: never two exports mixed, never someone else's files overwritten.

Why: `xmoe-convert export` used to write into `--out` in place. Over an earlier export it left that
export's shards and `model.safetensors.index.json` behind, so transformers and our own import read
stale weights; into a downloaded model's folder it overwrote config.json, the weights and the
tokenizer, with exit 0. Here, in order:
  1. `plan(out, overwrite, replace_tokenizer)`, before anything loads: `--out` is absent, empty, a
     folder holding only a tokenizer, or an earlier export of ours (its `xmoe_export.json` lists
     the files it wrote, with the sha256 of each small one) and `--overwrite` is given; anything
     else is refused in one line, as is a path through a file (missing parent folders are made).
  2. `staged(target)`: the export writes every file into a temporary sibling
     `.<name>.xmoe-export-<pid>` (removed on any error or Ctrl-C; `--out` untouched until then).
  3. on success the files to keep are linked into the sibling: a tokenizer the folder had that
     this tool did not write (a changed sha256 counts as not written), and any other file of
     someone else's (a README). Weights, the index and config.json never carry over. Then `--out`
     is renamed aside, the sibling renamed into place and the old folder removed.
A foreign tokenizer stays unless `--replace-tokenizer`; then the run's replaces all its files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from xmoe_jax.hf.mapping import ConversionError
from xmoe_jax.hf.safetensors_io import INDEX

MARKER = "xmoe_export.json"
# the files a tokenizer may consist of (transformers' tokenizer files, sentencepiece models)
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "special_tokens_map.json",
        "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "sentencepiece.bpe.model",
        "chat_template.jinja",
    }
)  # fmt: skip
HASHED_BELOW = 64 * 2**20  # files we write smaller than this are recorded with their sha256


@dataclasses.dataclass(frozen=True)
class Target:
    """Where an export goes and what of the folder already there survives it."""

    out: Path
    keep: tuple[str, ...] = ()  # entries of the existing `out` linked into the new one
    keep_tokenizer: bool = False  # the folder has its own tokenizer: the run's is not written

    @property
    def tokenizer_kept(self) -> list[str]:
        return [name for name in self.keep if name in TOKENIZER_FILES] if self.keep_tokenizer else []


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or name == INDEX or name in ("config.json", MARKER)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _written(out: Path) -> dict[str, str | None] | None:
    """The files the earlier export in `out` wrote (name -> sha256 or None), or None if no marker."""
    marker = out / MARKER
    if not marker.is_file():
        return None
    try:
        files = json.loads(marker.read_text())["files"]
        return {str(k): v for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}  # a damaged record: ours, but no file counts as written by us


def _ours(out: Path, name: str, written: dict[str, str | None]) -> bool:
    if name not in written or not (out / name).is_file():
        return False
    return written[name] is None or written[name] == _sha256(out / name)


def out_folder(out_dir: str | Path, what: str) -> Path:
    """`--out` as a folder to create or fill (`what` it is for): not a file, and no file where one of
    its parent folders should be (missing parents are created, as for a run directory); a link to
    a folder is followed."""
    out = Path(out_dir)
    out = out.resolve() if out.is_symlink() else out
    if out.exists() and not out.is_dir():
        raise ConversionError(f"--out {out_dir} is a file; give a folder for {what}")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConversionError(
                    f"--out {out_dir}: {parent} is a file, not a folder; give a path whose folders are folders"
                )
            break
    return out


def plan(out_dir: str | Path, overwrite: bool = False, replace_tokenizer: bool = False) -> Target:
    """Step 1 of the module docstring: what the export may do with `out_dir`, or a ConversionError."""
    out = out_folder(out_dir, "the export (new, or empty)")
    if not out.exists():
        return Target(out)
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return Target(out)
    written = _written(out)
    tokenizer = [n for n in names if n in TOKENIZER_FILES]
    if written is None:
        others = [n for n in names if n not in TOKENIZER_FILES]
        if others:
            raise ConversionError(
                f"--out {out_dir} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) "
                f"and holds no earlier export of xmoe-convert (no {MARKER}); export into a new or empty "
                "folder (--overwrite replaces only an earlier export)"
            )
        keep = () if replace_tokenizer else tuple(tokenizer)
        return Target(out, keep, keep_tokenizer=bool(keep))
    if not overwrite:
        raise ConversionError(
            f"--out {out_dir} holds an earlier export; pass --overwrite to replace it (its weights, "
            "config.json and the tokenizer it wrote go; a tokenizer or other file put there stays), or "
            "choose another folder"
        )
    foreign_tokenizer = any(not _ours(out, n, written) for n in tokenizer)
    keep_tokenizer = foreign_tokenizer and not replace_tokenizer
    keep = [n for n in tokenizer if keep_tokenizer]
    keep += [
        n for n in names if n not in TOKENIZER_FILES and not _is_weights(n) and not _ours(out, n, written)
    ]
    return Target(out, tuple(sorted(keep)), keep_tokenizer)


def _record(tmp: Path) -> None:
    """Writes the marker: every file of the new export, with the sha256 of the small ones that a
    later export might keep (not weights: those never carry over)."""
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file():
            small = p.stat().st_size < HASHED_BELOW and not _is_weights(p.name)
            files[p.name] = _sha256(p) if small else None
    (tmp / MARKER).write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def _carry(src: Path, dst: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        _link(str(src), str(dst))


@contextlib.contextmanager
def staged(target: Target) -> Iterator[Path]:
    """Steps 2-3 of the module docstring: yields the temporary folder to write the export into."""
    out = target.out.absolute()
    tmp = out.parent / f".{out.name}.xmoe-export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConversionError(
            f"--out {target.out}: cannot create a folder beside it ({e.strerror}); choose a folder you can write"
        ) from None
    try:
        yield tmp
        _record(tmp)  # before the kept files join: they are not ours
        for name in target.keep:
            if not (tmp / name).exists():
                _carry(out / name, tmp / name)
        if out.exists():
            old = out.parent / f".{out.name}.xmoe-export-old-{os.getpid()}"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # the earlier export back in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:  # an error or Ctrl-C while writing: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
