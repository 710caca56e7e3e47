"""xmoe-train's persistent compilation cache (launch/compile_cache.py, issue 31): where it lives,
how it is turned off, and that a folder it cannot create never stops a run."""

from __future__ import annotations

from pathlib import Path

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
