"""Writing output files: whole or not at all, and a write that fails in one line.

A full disk, a quota or a file-size limit (`ulimit -f`) must not end a tool with a traceback, nor
leave half a file that a later run takes for a whole one. The writers of the tools' outputs
(`xmoe-tokenize`'s shards, manifest and tokenizer copy; `xmoe-plot`'s pictures; the trainer's
config.yaml and metrics) use:
  - `writing(path)`: turns a failed write of `path` into a `WriteError` naming the file and the
    reason in a few words (`reason`), from an `OSError` or a library's error that carries one's
    text (ArrayRecord's RuntimeError, tensorstore's status);
  - `replacing(path)`: a temporary name beside `path`, renamed over it when the block succeeds and
    removed when it fails, so a reader sees the old file or the new one, never part of one.
A leaf: it imports nothing of xmoe_jax but the error root.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from xmoe_jax.errors import EXIT_FAILED, XmoeError

# the storage problems a write meets, most specific first (a quota before a full disk)
STORAGE_ERRNOS = (
    errno.EDQUOT,
    errno.ENOSPC,
    errno.EFBIG,  # a file-size limit: `ulimit -f`, a file system's largest file
    errno.EROFS,
    errno.EACCES,
    errno.EIO,
    errno.ENOENT,
    errno.ESTALE,
)
DEFAULT_FIX = "free space, raise the quota or the file-size limit (ulimit -f), or write elsewhere"


class WriteError(XmoeError):
    """A file could not be written (a full disk, a quota, a file-size limit, a read-only or vanished
    file system). `path` and `reason` let a caller restate it with the fix it knows (`with_fix`)."""

    exit_code = EXIT_FAILED  # failed while running, not bad input

    def __init__(self, path: str | os.PathLike, reason: str, fix: str = DEFAULT_FIX):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path} could not be written ({reason}); {fix}")

    def with_fix(self, fix: str) -> WriteError:
        return WriteError(self.path, self.reason, fix)


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception in one short line (tensorstore errors carry a whole spec)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {text[:limit]}"


def reason(e: BaseException) -> str:
    """The storage problem behind an error, in a few words ("No space left on device"); else its
    first line."""
    text = str(e)
    for code in STORAGE_ERRNOS:
        if (
            getattr(e, "errno", None) == code
            or os.strerror(code) in text
            or f"os_error_code='{code}'" in text
        ):
            return os.strerror(code)
    return first_line(e, 200)


@contextlib.contextmanager
def writing(path: str | os.PathLike, fix: str = DEFAULT_FIX) -> Iterator[None]:
    """Raises a `WriteError` naming `path` (and `fix`) if the block's write fails (an `OSError`, or
    the `RuntimeError` a native writer raises for one)."""
    try:
        yield
    except WriteError:
        raise
    except (OSError, RuntimeError) as e:
        raise WriteError(path, reason(e), fix) from e


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; renamed to `path` if the block
    succeeds, removed if it fails (`WriteError` naming `path` for a failed write)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with writing(path):
            yield tmp
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
