"""`xmoe-convert` at its edges (issue 31): exports that never mix with what the folder held, and one
line (status 2, the file and the field named) for every bad file, path or field.

One tiny run (numpy weights, nothing trained) and its export are shared by the module.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_hf_convert import MODELS, _assert_bitwise, _run, _weights

from xmoe_jax.cli_models import convert_main
from xmoe_jax.hf import ConversionError
from xmoe_jax.hf import safetensors_io as st
from xmoe_jax.hf.convert import export_checkpoint, import_checkpoint
from xmoe_jax.hf.export_dir import MARKER

REPO = pathlib.Path(__file__).resolve().parents[1]
FOREIGN_TOKENIZER = '{"model": "a downloaded tokenizer"}'


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("edges") / "run"
    _run(MODELS["qwen3_moe"], path)
    return path


@pytest.fixture(scope="module")
def hf(run) -> pathlib.Path:
    """An export of `run` in 4 files plus the index (the template of the damaged copies below)."""
    out = run.parent / "hf"
    export_checkpoint(run, out, max_shard_bytes=60_000)
    return out


def _error(capsys) -> str:
    """The one `error:` line a refused command printed last (progress lines may come before it)."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "Traceback" not in err and lines[-1].startswith("error: "), err
    assert sum(line.startswith("error: ") for line in lines) == 1, err
    return lines[-1]


def _names(folder: pathlib.Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _siblings(folder: pathlib.Path) -> list[str]:
    """Temporary folders an export left beside `folder` (there must be none)."""
    return [p.name for p in folder.parent.iterdir() if ".xmoe-export-" in p.name]


def test_export_over_an_older_sharded_export_and_a_foreign_tokenizer(run, hf, tmp_path, capsys) -> None:
    """The issue's case: the folder holds an earlier export in several files (its index too) and a
    tokenizer someone downloaded into it. Old code: the new single-file export left the 4 old
    shards and the index beside model.safetensors (transformers read the index: stale weights) and
    overwrote the tokenizer."""
    out = tmp_path / "out"
    shutil.copytree(hf, out)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / st.INDEX).is_file()
    (out / "tokenizer.json").write_text(FOREIGN_TOKENIZER)  # replaces the one the export wrote
    (out / "README.md").write_text("my notes")
    argv = ["export", "--run-dir", str(run), "--out", str(out)]

    assert convert_main(argv) == 2  # an earlier export is replaced only when asked
    err = _error(capsys)
    assert str(out) in err and "--overwrite" in err
    assert len(list(out.glob("model-*.safetensors"))) > 1  # untouched

    assert convert_main([*argv, "--overwrite"]) == 0
    captured = capsys.readouterr()
    assert "restoring step 0" in captured.err and "moving the export into place" in captured.err
    assert "kept the tokenizer" in captured.err
    # nothing stale: one file now, no index, no old shard; the foreign tokenizer and README stay
    assert _names(out) == {
        "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md", MARKER,
    }  # fmt: skip
    assert (out / "tokenizer.json").read_text() == FOREIGN_TOKENIZER
    assert (out / "README.md").read_text() == "my notes"
    assert not _siblings(out)
    assert set(st.Reader(out).keys()) == set(st.Reader(hf).keys())
    _assert_bitwise(_weights(import_checkpoint(out, tmp_path / "back").train.run_dir), _weights(run))

    # again, asked to: the run's tokenizer replaces the foreign one; the kept one stays foreign-marked
    assert convert_main([*argv, "--overwrite", "--replace-tokenizer"]) == 0
    assert (out / "tokenizer.json").read_text() == (hf / "tokenizer.json").read_text()
    assert "README.md" in _names(out)


def test_export_refuses_a_folder_that_is_not_an_earlier_export(run, hf, tmp_path, capsys) -> None:
    """A downloaded model's folder: old code overwrote its config.json, weights and tokenizer, exit 0."""
    downloaded = tmp_path / "Qwen3"
    shutil.copytree(hf, downloaded)
    (downloaded / MARKER).unlink()
    before = {p.name: p.read_bytes() for p in downloaded.iterdir()}
    for extra in ([], ["--overwrite"]):
        assert convert_main(["export", "--run-dir", str(run), "--out", str(downloaded), *extra]) == 2
        err = _error(capsys)
        assert str(downloaded) in err and "--overwrite" in err, err
        assert "not empty" in err
    assert {p.name: p.read_bytes() for p in downloaded.iterdir()} == before
    assert not _siblings(downloaded)


def test_export_into_a_folder_holding_only_a_tokenizer_keeps_it(run, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text(FOREIGN_TOKENIZER)
    files = export_checkpoint(run, out)
    assert "tokenizer.json" not in files and (out / "tokenizer.json").read_text() == FOREIGN_TOKENIZER
    assert {"model.safetensors", "config.json", MARKER} <= _names(out)


def test_an_interrupted_export_leaves_the_folder_as_it_was(run, hf, tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C while the shards are written: status 130, one line, the earlier export intact, no
    temporary folder left (old code: a traceback, and a folder half old, half new)."""
    out = tmp_path / "out"
    shutil.copytree(hf, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = st._to_file
    calls = []

    def interrupted(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(tensors, path)

    monkeypatch.setattr(st, "_to_file", interrupted)
    argv = ["export", "--run-dir", str(run), "--out", str(out), "--overwrite", "--max-shard-size", "20KB"]
    code = convert_main(argv)
    assert code == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "interrupted (Ctrl-C): xmoe-convert stopped" and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not _siblings(out)


def _damaged(hf: pathlib.Path, dest: pathlib.Path, config=None, drop_weights=False, shape_of=None):
    """A copy of the export with its config.json replaced (a string: the raw text) or a tensor
    cut by one row (`shape_of`)."""
    shutil.copytree(hf, dest)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (dest / "config.json").write_text(text)
    if drop_weights:
        for p in dest.glob("*.safetensors*"):
            p.unlink()
    if shape_of is not None:
        file = dest / json.loads((dest / st.INDEX).read_text())["weight_map"][shape_of]
        tensors = load_file(str(file))
        tensors[shape_of] = np.ascontiguousarray(tensors[shape_of][:-1])
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dest


def _config(hf: pathlib.Path) -> dict:
    return json.loads((hf / "config.json").read_text())


CASES = {  # name: (damage, what the one line must say besides the file)
    "damaged config.json": (lambda c: json.dumps(c)[:60], r"not valid JSON at line 1, column \d+"),
    "a list-valued config": (lambda c: [c], "holds a JSON list, not an object"),
    "no hidden_size": (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "'hidden_size' is missing"),
    "hidden_size a list": (lambda c: {**c, "hidden_size": [32]}, "'hidden_size' is \\[32\\]; it must be a whole"),
    "a flag as a string": (lambda c: {**c, "tie_word_embeddings": "false"}, "'tie_word_embeddings'.*true or false"),
    "rope factor not a number": (
        lambda c: {**c, "rope_scaling": {"type": "yarn", "factor": [4]}}, "'rope_scaling.factor'"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_config_json_is_one_line_naming_file_and_field(hf, tmp_path, case, capsys) -> None:
    damage, says = CASES[case]
    src = _damaged(hf, tmp_path / "hf", config=damage(_config(hf)))
    out = tmp_path / "run"
    assert convert_main(["import", "--hf-dir", str(src), "--out", str(out)]) == 2
    err = _error(capsys)
    assert str(src / "config.json") in err, err
    assert __import__("re").search(says, err), err
    assert not out.exists()


@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"])
def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(hf, tmp_path, tensor, capsys) -> None:
    """Old code: `cannot reshape array of size 992 into shape (32,4,8)`, or jax's shard message."""
    src = _damaged(hf, tmp_path / "hf", shape_of=tensor)
    assert convert_main(["import", "--hf-dir", str(src), "--out", str(tmp_path / "run")]) == 2
    err = _error(capsys)
    file = json.loads((src / st.INDEX).read_text())["weight_map"][tensor]
    assert str(src / file) in err and repr(tensor) in err and "shape" in err, err
    assert not (tmp_path / "run").exists()  # removed again: the next try is not refused


def test_no_safetensors_and_a_damaged_index_are_named(hf, tmp_path, capsys) -> None:
    bare = _damaged(hf, tmp_path / "bare", drop_weights=True)
    assert convert_main(["import", "--hf-dir", str(bare), "--out", str(tmp_path / "a")]) == 2
    err = _error(capsys)
    assert str(bare) in err and "no *.safetensors" in err, err
    index = _damaged(hf, tmp_path / "index")
    (index / st.INDEX).write_text("{")
    assert convert_main(["import", "--hf-dir", str(index), "--out", str(tmp_path / "b")]) == 2
    err = _error(capsys)
    assert str(index / st.INDEX) in err, err
    with pytest.raises(ConversionError, match="does not exist"):
        import_checkpoint(tmp_path / "nowhere", tmp_path / "c")


def test_out_paths_that_are_a_file_or_go_through_one(run, hf, tmp_path, capsys) -> None:
    """Old code: FileExistsError / NotADirectoryError tracebacks."""
    file = tmp_path / "a_file"
    file.write_text("x")
    for command in (["export", "--run-dir", str(run)], ["import", "--hf-dir", str(hf)]):
        for out, says in (
            (file, f"--out {file} is a file"),
            (file / "out", f"{file} is a file, not a folder"),
        ):
            assert convert_main([*command, "--out", str(out)]) == 2
            assert says in _error(capsys)
    assert convert_main(["import", "--hf-dir", str(hf), "--out", str(run)]) == 2  # before anything loads
    assert "already holds a run" in _error(capsys)


def test_import_names_the_next_commands_for_a_pretrained_model(hf, tmp_path, capsys) -> None:
    """Old code: 'continue training with: xmoe-train ... --resume' (on synthetic numbers)."""
    out = tmp_path / "run"
    assert convert_main(["import", "--hf-dir", str(hf), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"xmoe-generate --run-dir {out} --prompt" in printed.out
    assert f"--tokenizer {out}/tokenizer --output data/corpus" in printed.out
    assert "--set data.path=data/corpus" in printed.out and "continue training" not in printed.out
    assert "reading the tensors" in printed.err and "writing step 0" in printed.err


@pytest.mark.slow  # a subprocess that imports JAX: ~20 s on a shared CPU
def test_ctrl_c_while_the_checkpoint_is_read_is_one_line_and_130(run, hf, tmp_path) -> None:
    """A real SIGINT while orbax restores the weights. Old code: a traceback; with only the
    KeyboardInterrupt caught, orbax's "step 0 ... cannot be read: it is damaged" (status 2) or a
    segmentation fault in the interpreter's teardown (status 139)."""
    out = tmp_path / "out"
    shutil.copytree(hf, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code = (  # Ctrl-C as in a terminal (a background pytest starts its children with SIGINT ignored)
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from xmoe_jax.cli_models import convert_main; sys.exit(convert_main())"
    )
    argv = [sys.executable, "-c", code, "export", "--run-dir", str(run), "--out", str(out), "--overwrite"]
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, env=environ, cwd=REPO, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    assert first.startswith("restoring step 0"), first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    err = first + proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err
    assert err.splitlines()[-1] == "interrupted (Ctrl-C): xmoe-convert stopped" and "Traceback" not in err, (
        err
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not _siblings(out)


# ----------------------------------------------------------------------------- issues 37 (3.1, 3.3) and 38


def _during_export(monkeypatch, action) -> None:
    """Runs `action()` once while the export writes its first safetensors file."""
    real, done = st._to_file, []

    def hooked(tensors, path):
        if not done:
            done.append(action())
        real(tensors, path)

    monkeypatch.setattr(st, "_to_file", hooked)


def test_files_put_into_out_during_an_export_stay(run, hf, tmp_path, monkeypatch, capsys) -> None:
    """Issue 37 3.1: `--out` was checked at the start and swapped at the end, so a file put there
    meanwhile was deleted, exit 0. Over an earlier export it is carried over; into a folder that
    was empty it makes the folder someone else's: the export is refused at the swap."""
    out = tmp_path / "out"
    shutil.copytree(hf, out)
    _during_export(monkeypatch, lambda: (out / "notes.txt").write_text("mine"))
    assert convert_main(["export", "--run-dir", str(run), "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert not _siblings(out)
    capsys.readouterr()

    empty = tmp_path / "empty"
    empty.mkdir()
    _during_export(monkeypatch, lambda: (empty / "weights.bin").write_text("someone's"))
    assert convert_main(["export", "--run-dir", str(run), "--out", str(empty)]) == 2
    err = _error(capsys)
    assert "changed during the export" in err and "weights.bin" in err, err
    assert _names(empty) == {"weights.bin"} and not _siblings(empty)


def test_two_exports_to_one_out_never_both_succeed(run, hf, tmp_path, monkeypatch, capsys) -> None:
    """Issue 37 3.1: two exports to one `--out` both reported success, one's weights gone. The
    second is refused while the first holds the folder, naming it."""
    out = tmp_path / "out"
    argv = ["export", "--run-dir", str(run), "--out", str(out), "--overwrite"]
    second = []
    _during_export(monkeypatch, lambda: second.append((convert_main(argv), _error(capsys))))
    assert convert_main(argv) == 0
    code, err = second[0]
    assert code == 2 and f"{tmp_path} is in use by another xmoe-convert export: pid {os.getpid()}" in err, err
    assert "choose another --out" in err
    assert (out / "model.safetensors").is_file() and not _siblings(out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the lock file gone too


def test_a_hard_killed_exports_folders_are_put_back_or_removed(run, hf, tmp_path, capsys) -> None:
    """Issue 37 3.1: a SIGKILL mid-export left `.out.xmoe-export-<pid>` (partial), or, during the
    swap, the earlier export as `.out.xmoe-export-old-<pid>` with `--out` gone. The next export
    puts the earlier one back (then replaces it as asked) and removes the partial one, naming both."""
    out = tmp_path / "out"
    shutil.copytree(hf, tmp_path / ".out.xmoe-export-old-4194305")  # --out moved aside, then killed
    (tmp_path / ".out.xmoe-export-4194305").mkdir()
    (tmp_path / ".out.xmoe-export-4194305" / "shard-00000.tmp").write_bytes(b"half")
    assert convert_main(["export", "--run-dir", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"put back {out}" in err and "removed" in err and ".out.xmoe-export-4194305" in err, err
    assert "holds an earlier export; pass --overwrite" in err  # the put-back export is not lost
    assert (out / MARKER).is_file() and not _siblings(out)
    shutil.copytree(hf, tmp_path / ".out.xmoe-export-old-4194306")  # killed after the swap
    assert convert_main(["export", "--run-dir", str(run), "--out", str(out), "--overwrite"]) == 0
    assert "the replaced export of a killed export (pid 4194306)" in capsys.readouterr().err
    assert not _siblings(out)


def test_a_write_failure_is_one_line_status_1_and_leaves_nothing(
    run, hf, tmp_path, monkeypatch, capsys
) -> None:
    """Issue 37 3.3: a full disk or a quota gave a 21-33-line traceback and could leave a partial
    folder. A real `ulimit -f` (Python turns it into EFBIG; safetensors raises its own error), then a
    full disk at the marker (an OSError)."""
    import errno
    import resource

    from xmoe_jax.hf import export_dir

    out = tmp_path / "out"
    shutil.copytree(hf, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["export", "--run-dir", str(run), "--out", str(out), "--overwrite"]

    def full_disk(tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / MARKER))

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        codes = [convert_main(argv)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    errors = [_error(capsys)]
    monkeypatch.setattr(export_dir, "_record", full_disk)
    codes.append(convert_main(argv))
    errors.append(_error(capsys))
    assert codes == [1, 1]
    for err, reason in zip(errors, ("File too large", "No space left on device"), strict=True):
        assert "could not be written" in err and reason in err and "nothing of it is left" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not _siblings(out) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_exported_files_follow_the_umask(run, tmp_path) -> None:
    """Issue 38: safetensors wrote the weights 0600, so a shared model folder was unreadable to the
    group; `save_pretrained` follows the umask, and so does the export now."""
    for umask, mode in ((0o022, 0o644), (0o007, 0o660)):
        previous = os.umask(umask)
        try:
            out = tmp_path / f"out{umask:o}"
            export_checkpoint(run, out)
        finally:
            os.umask(previous)
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert modes["model.safetensors"] == mode and modes["config.json"] == mode, modes


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_import_refuses_a_nonfinite_weight_naming_it_unless_asked(hf, tmp_path, bad, capsys) -> None:
    """Issue 38: a NaN or infinite weight was imported without a word (the run then trained on NaN)."""
    tensor = "model.layers.1.self_attn.q_proj.weight"
    src = _damaged(hf, tmp_path / "hf")
    file = src / json.loads((src / st.INDEX).read_text())["weight_map"][tensor]
    tensors = load_file(str(file))
    tensors[tensor] = tensors[tensor].copy()
    tensors[tensor][3, 5] = bad
    save_file(tensors, str(file), metadata={"format": "pt"})
    out = tmp_path / "run"
    assert convert_main(["import", "--hf-dir", str(src), "--out", str(out)]) == 2
    err = _error(capsys)
    what = "1 NaN and 0 infinite" if bad != bad else "0 NaN and 1 infinite"
    assert f"tensor {tensor!r} of {file} holds {what} values" in err and "--allow-nonfinite" in err, err
    assert not out.exists()
    if bad != bad:  # asked for: imported as it is (once: an import takes seconds)
        assert convert_main(["import", "--hf-dir", str(src), "--out", str(out), "--allow-nonfinite"]) == 0
        assert (out / "config.yaml").is_file()
