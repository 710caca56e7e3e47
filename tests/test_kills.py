"""Hard kills and damaged checkpoints, end to end (CPU, 8 fake devices, the tiny model).

A run killed with SIGKILL at seeded random moments (during a step, during an asynchronous save,
during the final save) and resumed each time ends with exactly the losses of an uninterrupted
run; a bit flip in the newest checkpoint makes the resume fall back to the previous step.
"""

from __future__ import annotations

import random
import re
import shutil
import signal
from functools import partial

import pytest
from clirun import STEPS, Cli, args, env, losses, tiny_config

from xmoe_jax.train.loop import train

SEED = 20260521


def _tmp_dirs(ckpts) -> set[str]:
    return {p.name for p in ckpts.iterdir() if ".orbax-checkpoint-tmp" in p.name} if ckpts.is_dir() else set()


def _first_step(cli: Cli) -> int:
    cli.wait_until(lambda: re.search(r"step +\d+/", cli.out), 240, "a first step")
    return int(re.search(r"step +(\d+)/", cli.out).group(1))


@pytest.mark.slow  # ~65 s; one process's SIGTERM and resume: test_preemption.py
def test_kills_at_random_moments_then_resume_equal_an_uninterrupted_run(
    tmp_path, tiny_reference, compile_cache
):
    """Four SIGKILLs, then a resume that finishes. Synchronous saves make the two kills in a step
    land after a complete checkpoint; asynchronous saves give a save to kill."""
    rng = random.Random(SEED)
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    errs = []
    for attempt, (where, saves) in enumerate(
        [("step", "false"), ("save", "true"), ("step", "false"), ("final save", "true")]
    ):
        argv = args(run, f"checkpoint.async_save={saves}")
        cli = Cli(
            argv + (["--resume"] if attempt else []), env(8, compile_cache), tmp_path, f"attempt{attempt}"
        )
        if where == "step":  # once a seeded step is logged: during the next step (or its save)
            cli.wait_for_step(rng.randint(_first_step(cli), STEPS - 1))
        else:  # as soon as a new temporary checkpoint folder appears
            want = f"{STEPS}.orbax-checkpoint-tmp" if where == "final save" else ".orbax-checkpoint-tmp"
            before = _tmp_dirs(ckpts)
            saving = partial(
                lambda want, before: any(want in d for d in _tmp_dirs(ckpts) - before), want, before
            )
            cli.wait_until(saving, 240, f"a {where}", poll=0.002)
        cli.signal(signal.SIGKILL)
        assert cli.wait(60) == -signal.SIGKILL, f"attempt {attempt} ({where}) was not killed:\n{cli.err}"
        errs.append(cli.err)
    last = Cli(args(run) + ["--resume"], env(8, compile_cache), tmp_path, "last")
    assert last.wait(120) == 0, last.err
    errs.append(last.err)
    _, expected = tiny_reference
    assert losses(run) == expected  # every step once, bitwise equal
    resumes = "".join(errs[1:])
    assert "resumed from" in resumes  # at least one resume started from a checkpoint
    assert "is an interrupted save that never completed; moved to" in resumes
    assert "metrics.jsonl:" in resumes and "moved to" in resumes  # the lost steps' records set aside
    assert not _tmp_dirs(ckpts)


@pytest.mark.slow  # ~30 s with its reference run; damaged checkpoints: test_integrity.py
def test_a_bit_flip_in_the_newest_checkpoint_falls_back_to_the_previous_step(
    tmp_path, tiny_reference, caplog
):
    source, expected = tiny_reference
    run = tmp_path / "run"
    shutil.copytree(source, run)  # finished: checkpoints at steps 4, 8 and 12
    newest = run / "checkpoints" / str(STEPS)
    victim = max((p for p in (newest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x04
    victim.write_bytes(bytes(data))

    with caplog.at_level("WARNING", "xmoe_jax"):
        resumed = train(tiny_config(run, "train.steps=14"), resume=True)
    assert sorted(resumed.losses) == list(range(9, 15))  # fell back to step 8
    assert resumed.losses[9] == expected[9]  # step 9's loss needs exactly step 8's state and data
    assert f"checkpoint step {STEPS} in {run / 'checkpoints'}" in caplog.text
    assert (run / "checkpoints" / "rejected" / str(STEPS)).is_dir()
    assert [r for r in losses(run)] == list(range(1, 15))
    assert (run / "metrics.discarded.jsonl").read_text().count("\n") == 4  # steps 9-12 of the first run
