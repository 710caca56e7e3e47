"""Storage faults (issue 23 2.1 and 2.11): a checkpoint folder that cannot take a file is found in
milliseconds with one line naming it, and a write that fails in orbax's background thread (a full
disk) ends the run with one line saying the earlier checkpoints are intact, not pages of tracebacks.

Root writes through permission bits, so the fast tests simulate the faults (the probe's create
fails with EROFS; orbax's wait raises tensorstore's ENOSPC error); the slow test mounts a real,
tiny tmpfs where this process may mount (root with CAP_SYS_ADMIN) and is skipped elsewhere."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from tests import clirun
from xmoe_jax.cli import _drop_closed_loop_callbacks, _one_line_orbax_errors
from xmoe_jax.config import CheckpointConfig
from xmoe_jax.train import rundir, writable
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointWriteError

ENOSPC_TEXT = (
    'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "x/": Failed to '
    "write 2551607 bytes to file 4: No space left on device [os_error_code='28']\nmore lines"
)


def test_a_save_into_a_folder_that_cannot_take_a_file_fails_at_once_naming_it(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(every=1))

    def read_only(directory):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(writable, "probe_write", read_only)
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(1, {"w": jnp.ones(4)})
    msg = str(e.value)
    assert msg.startswith(f"checkpoint step 1 could not be written to {tmp_path / 'checkpoints'}: Read-only")
    assert "steps saved before it are intact" in msg and "--resume" in msg and "\n" not in msg
    assert ckpt.all_steps() == []
    ckpt.close()


def test_a_failed_background_write_is_one_line_and_the_orbax_logs_too(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(every=1))
    assert ckpt.save(1, {"w": jnp.ones(4)})
    ckpt.wait()

    def full(*a, **k):
        raise ValueError(ENOSPC_TEXT)

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", full)
    with pytest.raises(CheckpointWriteError, match=r"could not be written to .*: No space left on device\. "):
        ckpt.wait()
    monkeypatch.setattr(ckpt._manager, "close", full)
    ckpt.close()  # reported once already: no second error
    try:
        raise ValueError(ENOSPC_TEXT)
    except ValueError:
        record = logging.getLogger("absl").makeRecord(
            "absl", logging.ERROR, "f", 1, "failed: %s", (ENOSPC_TEXT,), None
        )
        record.exc_info = sys.exc_info()
    assert _one_line_orbax_errors(record)
    assert record.exc_info is None and "\n" not in logging.Formatter().format(record)


EFBIG_TEXT = (
    'OUT_OF_RANGE: Error writing "opt.1.0.mu.dense_layers.attn.wq/0.0.0.0" in OCDBT database at local file '
    '"r1/checkpoints/4.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": Error writing '
    "file: r1/x: File too large [OS error 27: File too large]"
)


def test_a_full_disk_under_training_is_the_trainers_line_only(tmp_path):
    """Issue 37 3.3: under `ulimit -f` a failed save printed four long orbax lines (its background
    threads' `logging.exception`s) before the trainer's own, which named tensorstore's status
    (OUT_OF_RANGE) instead of the file-size limit."""
    orbax = os.path.join("site-packages", "orbax", "checkpoint", "checkpoint_manager.py")
    try:  # raised in orbax's code, as its background save raises it
        exec(compile("raise ValueError(EFBIG_TEXT)", orbax, "exec"), {"EFBIG_TEXT": EFBIG_TEXT})
    except ValueError:
        record = logging.getLogger("absl").makeRecord(
            "absl",
            logging.ERROR,
            "absl/logging/__init__.py",
            1,
            "Save Finalize thread failed.",
            (),
            sys.exc_info(),
        )
    assert not _one_line_orbax_errors(record)
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(every=1))
    error = ckpt._write_error(4, ValueError(EFBIG_TEXT))
    assert f"checkpoint step 4 could not be written to {tmp_path / 'checkpoints'}: File too large." in str(
        error
    )
    ckpt.close()


def test_the_echoes_of_a_failed_write_are_dropped_and_other_errors_kept(monkeypatch):
    """CI's full-disk run printed 413 lines: asyncio's "Task exception was never retrieved" copy of the
    failed write, and ~100 "Event loop is closed" tracebacks from tensorstore writes that finished
    after orbax closed the failed save's event loop (they reach sys.unraisablehook)."""
    try:
        raise ValueError(ENOSPC_TEXT)
    except ValueError:
        record = logging.getLogger("asyncio").makeRecord(
            "asyncio", logging.ERROR, "f", 1, "Task exception was never retrieved", (), None
        )
        record.exc_info = sys.exc_info()
    assert not _one_line_orbax_errors(record)

    class Unraisable:
        exc_type, exc_traceback, err_msg, object = RuntimeError, None, None, None

    printed = []
    monkeypatch.setattr(sys, "__unraisablehook__", printed.append)
    closed, other = Unraisable(), Unraisable()
    closed.exc_value, other.exc_value = RuntimeError("Event loop is closed"), RuntimeError("boom")
    _drop_closed_loop_callbacks(closed)
    _drop_closed_loop_callbacks(other)
    assert printed == [other]


def _mount(path, options: str) -> bool:
    path.mkdir(parents=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "none", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow  # ~70 s: two CLI runs, one of them training to its second save
def test_real_read_only_and_full_checkpoint_mounts(tmp_path, tmp_path_factory):
    ro, full = tmp_path / "ro", tmp_path / "full"
    if not _mount(ro / "checkpoints", "ro,size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        env = clirun.env(8, clirun.session_cache_dir(tmp_path_factory))
        run = clirun.Cli(clirun.args(ro), env, tmp_path, "ro")
        assert run.wait(120) == 2
        assert (
            f"the checkpoint folder {ro / 'checkpoints'} is not writable (Read-only file system)" in run.err
        )
        assert _mount(full / "checkpoints", "size=5m")  # the tiny model's checkpoint is ~4 MB
        run = clirun.Cli(clirun.args(full, "checkpoint.every=2", "checkpoint.keep=5"), env, tmp_path, "full")
        assert run.wait(240) == 1
        assert "could not be written to" in run.err and "No space left on device" in run.err
        # the start-up summary (now with its compilation-cache line) and one line for the failed save
        problems = [line for line in run.err.splitlines() if not line.startswith("INFO ")]
        assert len(problems) < 6 and "Traceback" not in run.err, run.err
        assert not (full / rundir.LOCK_NAME).exists()
    finally:
        for path in (ro, full):
            subprocess.run(["umount", "-l", str(path / "checkpoints")], capture_output=True)


def test_rejected_keeps_only_the_newest_few(tmp_path, caplog):
    """Issue 23 2.11: every interrupted save stayed in rejected/ forever (a big model's full size per
    kill on a preemptible queue)."""
    from xmoe_jax.train import integrity

    for i in range(integrity.KEEP_REJECTED + 2):
        (tmp_path / f"{i}.orbax-checkpoint-tmp-{i}").mkdir()
        (tmp_path / f"{i}.orbax-checkpoint-tmp-{i}" / "data").write_text("x")
        dest = integrity.reject(tmp_path, f"{i}.orbax-checkpoint-tmp-{i}", "is an interrupted save")
        os.utime(dest, (1000 + i, 1000 + i))  # distinct times on coarse clocks
    kept = sorted(p.name for p in (tmp_path / integrity.REJECTED_DIR).iterdir())
    newest = [f"{i}.orbax-checkpoint-tmp-{i}" for i in range(2, integrity.KEEP_REJECTED + 2)]
    assert kept == newest
    assert f"only the newest {integrity.KEEP_REJECTED} set-aside checkpoints are kept" in caplog.text


def test_metrics_jsonl_is_strict_json_with_null_for_non_finite(tmp_path):
    """Issue 23 2.11: metrics.jsonl wrote bare NaN, which strict JSON readers reject."""
    import io
    import json

    from xmoe_jax.train.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 2, stream=io.StringIO())
    speed = {"tokens_per_s": 1.0, "tflops_per_device": 0.0}
    logger.log(
        {"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "load": [1.0, float("nan")], **speed}
    )
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    strict = json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert strict == {"step": 1, "loss": None, "grad_norm": None, "load": [1.0, None], **speed}


def test_prompt_ids_that_are_not_integers_name_the_flag(tmp_path, capsys):
    from xmoe_jax.cli_models import generate_main

    assert generate_main(["--run-dir", str(tmp_path), "--prompt-ids", "a b"]) == 2
    err = capsys.readouterr().err
    assert "--prompt-ids 'a b': 'a' is not a token id" in err and "--prompt-ids '1 2 3'" in err


def test_the_trainers_own_files_on_a_full_disk_are_one_line(tmp_path, monkeypatch):
    """Issue 37 3.3: config.yaml and metrics.jsonl on a full disk ended the run with a traceback
    (config.yaml left half written)."""
    import io
    import pathlib

    from xmoe_jax.config import Config
    from xmoe_jax.storage import WriteError
    from xmoe_jax.train.metrics import MetricsLogger

    def full(self, *a, **k):
        self.open("w").write("half")  # what a full disk leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_text", full)
        with pytest.raises(
            WriteError, match=r"config.yaml could not be written \(No space left on device\); free"
        ):
            rundir.RunDir(tmp_path).write_config(Config())
    assert os.listdir(tmp_path) == []  # neither config.yaml nor its partial copy

    class FullFile(io.StringIO):
        def flush(self):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    logger = MetricsLogger(tmp_path, 2, stream=io.StringIO())
    logger._file = FullFile()
    with pytest.raises(WriteError) as e:
        logger.log({"step": 1, "loss": 1.0, "tokens_per_s": 1.0, "tflops_per_device": 0.0})
    assert f"{tmp_path / 'metrics.jsonl'} could not be written (Disk quota exceeded)" in str(e.value)
    assert "run the same command with --resume" in str(e.value)
    logger.close()  # reported already: no second error
