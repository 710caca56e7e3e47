"""xmoe-train's persistent compilation cache (launch/compile_cache.py, issue 31): where it lives,
how it is turned off, and that a folder it cannot create never stops a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from xmoe_jax.launch import compile_cache


def test_the_folder_comes_from_the_flag_then_the_environment_then_the_default(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "xmoe_jax" / "jax"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.cache_dir() == tmp_path / "env"
    assert compile_cache.cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert compile_cache.cache_dir("off") is None and compile_cache.cache_dir("OFF ") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.cache_dir() is None
    assert compile_cache.cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"  # the flag wins
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv(compile_cache.ENV, "")
    assert compile_cache.cache_dir() == Path.home() / ".cache" / "xmoe_jax" / "jax"


def test_a_folder_that_cannot_be_made_leaves_the_cache_off(tmp_path):
    (tmp_path / "a_file").write_text("x")
    assert compile_cache.enable(str(tmp_path / "a_file" / "cache")) is None
    assert compile_cache.enable("off") is None


def test_xmoe_train_has_the_flag():
    import contextlib
    import io

    from xmoe_jax.cli import train_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        train_main(["--help"])
    assert "--compile-cache" in out.getvalue() and "xmoe_jax/jax" in out.getvalue()


# ----------------------------------------------------------------------------- issues 37 (3.2) and 38


def _read_only(monkeypatch, folder: Path) -> None:
    """A read-only mount, as root meets it too: creating a file under `folder` fails with EROFS."""
    import errno
    import os

    real_open = os.open

    def open_(path, flags, *a, **kw):
        if str(path).startswith(str(folder)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", open_)


def test_a_read_only_folder_leaves_the_cache_off_saying_why_once(tmp_path, monkeypatch, caplog):
    """Issue 38: a read-only cache folder was turned on: JAX then printed two UserWarnings per
    compiled program (its writes failed), and the start-up line said the cache was on."""
    import jax

    folder = tmp_path / "cache"
    folder.mkdir()
    _read_only(monkeypatch, folder)
    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.enable(str(folder)) is None
    assert jax.config.jax_compilation_cache_dir == before  # JAX never tries to write there
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "compilation cache off" in lines[0], lines
    assert f"{folder} cannot be written (Read-only file system)" in lines[0] and "--compile-cache" in lines[0]


def _entry(folder: Path, name: str, payload: bytes) -> Path:
    import zlib

    path = folder / f"{name}-cache"
    path.write_bytes(zlib.compress(payload))  # JAX's format without zstd installed
    return path


def test_damaged_entries_are_dropped_in_one_line_and_intact_ones_checked_once(tmp_path, monkeypatch, caplog):
    """Issue 37 3.2: a full disk or a kill mid-write left a truncated entry, which JAX warned about
    and recompiled at every later start. Damaged entries go, with one line; intact ones stay, and
    are not read again at the next start."""
    import jax

    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # this process's JAX stays as it is
    caplog.set_level("INFO", logger="xmoe_jax")
    folder = tmp_path / "cache"
    folder.mkdir()
    good = _entry(folder, "jit_f-1", b"executable" * 1000)
    cut = _entry(folder, "jit_g-2", b"executable" * 1000)
    cut.write_bytes(cut.read_bytes()[:-40])  # a write cut short
    (folder / "jit_h-3-cache").write_bytes(b"")  # a kill right after the open
    assert compile_cache.enable(str(folder)) == folder
    assert sorted(p.name for p in folder.glob("*-cache")) == [good.name]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "dropped 2 damaged entries" in warnings[0] and str(folder) in warnings[0]
    caplog.clear()
    monkeypatch.setattr(compile_cache, "_intact", lambda data: pytest.fail("an entry checked twice"))
    assert compile_cache.enable(str(folder)) == folder  # the record holds it: not read again
    assert [r.getMessage() for r in caplog.records] == [f"compilation cache: {folder}"]


@pytest.mark.slow  # an xmoe-train subprocess that compiles without a cache: ~40 s on a shared CPU
def test_xmoe_train_with_a_cache_it_cannot_write_says_off_once(tmp_path):
    """Issue 38, through the CLI: a cache folder that exists but takes no file (sysfs) printed two
    JAX UserWarnings per compiled program while the start-up line said the cache was on."""
    import os
    import subprocess
    import sys

    from clirun import REPO, args, env

    folder = Path("/sys/kernel")
    try:
        os.close(os.open(folder / ".xmoe-probe", os.O_CREAT | os.O_WRONLY, 0o644))
        pytest.skip("/sys/kernel takes files on this machine: no unwritable folder to test with")
    except OSError:
        pass
    environ = {k: v for k, v in env(8, tmp_path).items() if not k.startswith("JAX_COMPILATION_CACHE")}
    argv = [*args(tmp_path / "run", "train.steps=2"), "--compile-cache", str(folder)]
    proc = subprocess.run(
        [sys.executable, "-m", "xmoe_jax.cli", *argv], env=environ, cwd=REPO, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "compilation cache" in line or "persistent" in line]
    assert len(lines) == 1 and f"compilation cache off: {folder} cannot be written" in lines[0], lines
    assert "UserWarning" not in proc.stderr
