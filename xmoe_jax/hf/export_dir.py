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
  3. on success `--out` is planned again (the check at the swap: files put there during the export
     are someone else's, and a folder that is no longer ours to replace is refused, the export
     discarded). The files to keep are linked into the sibling: a tokenizer the folder had that
     this tool did not write (a changed sha256 counts as not written), and any other file of
     someone else's (a README). Weights, the index and config.json never carry over. Then `--out`
     is renamed aside, the sibling renamed into place, a file that arrived in between moved over,
     and the old folder removed.
A foreign tokenizer stays unless `--replace-tokenizer`; then the run's replaces all its files.

`held(out)` wraps all of it: one export per `--out` at a time, through the run directory's lock
(`runlock.RunLock` on `.<name>.xmoe-export.lock` beside `--out`, which the swap never moves). Holding
it, the export first deals with what a hard-killed export left beside `--out`: a partial sibling is
removed, and an earlier export moved aside is put back (if `--out` is gone) or removed (if the swap
had finished), each named. A write that fails (a full disk, a quota, `ulimit -f`) is an
`ExportWriteError`: one line, status 1, the sibling removed and `--out` as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from xmoe_jax.errors import ConfigError, XmoeError
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
TMP, OLD = ".xmoe-export-", ".xmoe-export-old-"  # `.<name>` + these + a pid: the siblings of a swap


class ExportWriteError(XmoeError):
    """The export could not be written (a full disk, a quota); nothing of it is left behind."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where an export goes and what of the folder already there survives it."""

    out: Path
    keep: tuple[str, ...] = ()  # entries of the existing `out` linked into the new one
    keep_tokenizer: bool = False  # the folder has its own tokenizer: the run's is not written
    overwrite: bool = False  # as asked: the check at the swap plans again with them
    replace_tokenizer: bool = False
    names: tuple[str, ...] = ()  # the entries `out` held when planned

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
    asked = {"overwrite": overwrite, "replace_tokenizer": replace_tokenizer}
    if not out.exists():
        return Target(out, **asked)
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return Target(out, **asked)
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
        return Target(out, keep, bool(keep), names=tuple(names), **asked)
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
    return Target(out, tuple(sorted(keep)), keep_tokenizer, names=tuple(names), **asked)


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
def held(out_dir: str | Path, report: Callable[[str], None]) -> Iterator[None]:
    """One export per `--out` for the whole export (the module docstring's last paragraph); then
    what a killed export left beside it is removed or put back, each named to `report`."""
    from xmoe_jax.train.runlock import RunLock

    out = out_folder(out_dir, "the export (new, or empty)").absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConversionError(
            f"--out {out_dir}: cannot create its folder {out.parent} ({e.strerror}); choose a folder you can write"
        ) from None
    lock = RunLock(
        out.parent,
        out.parent / f".{out.name}.xmoe-export.lock",
        "another xmoe-convert export",
        "choose another --out",
    )
    try:
        lock.acquire()
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    except OSError as e:
        raise ConversionError(
            f"--out {out_dir}: cannot create a file beside it ({e.strerror}); choose a folder you can write"
        ) from None
    try:
        _recover(out, report)
        yield
    finally:
        lock.release()


def _recover(out: Path, report: Callable[[str], None]) -> None:
    """The siblings a hard-killed export left (no other export runs: we hold the lock)."""
    for sibling in sorted(out.parent.glob(f".{glob.escape(out.name)}{TMP}*")):
        pid = sibling.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        if sibling.name.startswith(f".{out.name}{OLD}") and not out.exists():
            os.rename(sibling, out)
            report(f"put back {out}: a killed export (pid {pid}) had moved it aside to {sibling.name}")
        else:
            shutil.rmtree(sibling, ignore_errors=True)
            what = "the replaced export" if OLD in sibling.name else "the partial output"
            report(f"removed {sibling}: {what} of a killed export (pid {pid})")


def _swap(tmp: Path, target: Target) -> None:
    """Step 3 of the module docstring, from the check to the removal of the old folder."""
    out = target.out.absolute()
    try:
        now = plan(out, target.overwrite, target.replace_tokenizer)
    except ConversionError as e:
        raise ConversionError(f"--out changed during the export, which was discarded: {e}") from None
    if not out.exists():
        try:
            os.rename(tmp, out)  # over an empty folder made meanwhile; never over a filled one
        except OSError as e:
            raise ConversionError(
                f"--out {target.out} was made and filled during the export ({e.strerror}), which was discarded; "
                "export into a new or empty folder"
            ) from None
        return
    for name in now.keep:
        if not (tmp / name).exists():
            _carry(out / name, tmp / name)
    old = out.parent / f".{out.name}{OLD}{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # the earlier export back in place
        raise
    late = [p for p in old.iterdir() if p.name not in now.names]  # put there after the check
    for p in late:
        if not (out / p.name).exists():
            os.rename(p, out / p.name)
    left = [p.name for p in old.iterdir() if p.name not in now.names]
    if left:
        raise ConversionError(
            f"the export is in {out}, but {', '.join(left)} arrived in it during the export under a name "
            f"the export wrote too: the earlier folder is kept as {old}; take what you need from it, then remove it"
        )
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged(target: Target) -> Iterator[Path]:
    """Steps 2-3 of the module docstring: yields the temporary folder to write the export into."""
    out = target.out.absolute()
    tmp = out.parent / f".{out.name}{TMP}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConversionError(
            f"--out {target.out}: cannot create a folder beside it ({e.strerror}); choose a folder you can write"
        ) from None
    try:
        try:
            yield tmp
            _record(tmp)  # before the kept files join: they are not ours
        except (OSError, _safetensor_error()) as e:
            raise ExportWriteError(
                f"the export could not be written beside {target.out} ({_reason(e)}); nothing of it is left "
                f"and {target.out} is as it was: free space (or raise the quota or `ulimit -f`), then run the same command"
            ) from None
        try:
            _swap(tmp, target)
        except OSError as e:  # carrying a kept file (a copy across file systems) or a rename
            raise ExportWriteError(
                f"the export could not be moved into {target.out} ({_reason(e)}); nothing of it is left and "
                f"{target.out} is as it was: fix what the reason names, then run the same command"
            ) from None
    except BaseException:  # an error or Ctrl-C while writing: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _safetensor_error() -> type[Exception]:
    """safetensors' own error class (a full disk while it writes a file raises it)."""
    from safetensors import SafetensorError

    return SafetensorError


def _reason(e: Exception) -> str:
    """The cause in a few words: an OSError's, or the I/O error inside safetensors' message."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = text.split("I/O error: ")[
        -1
    ]  # "Error while serializing: I/O error: File too large (os error 27)"
    return cause.split(" (os error")[0]
