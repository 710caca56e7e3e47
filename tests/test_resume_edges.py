"""`--resume` semantics and the hard-kill bound (issue 23 2.5, 2.10, 2.11).

- `--resume` never writes over a run it cannot continue (one that saved no checkpoints, or one of
  another model); with no checkpoint it says "starting at step 0"; a `train.run_dir` that does not
  exist is refused unless `--resume-or-start`.
- A finished run resumed again exits 0, "already finished" (a restart loop's last round).
- Before the step whose save is due runs, the previous save is on disk: a kill at any moment then
  loses fewer than `2 * checkpoint.every` steps (before: exactly `2 * every` at the worst moment).
"""

from __future__ import annotations

import logging

import pytest
import yaml
from clirun import STEPS, args, tiny_config

from xmoe_jax.cli import train_main
from xmoe_jax.config import ConfigError, to_dict
from xmoe_jax.train import loop
from xmoe_jax.train.checkpoint import Checkpointer


def test_resume_of_a_path_that_does_not_exist_is_refused(tmp_path, capsys):
    run = tmp_path / "typo"
    with pytest.raises(
        ConfigError, match=r"train.run_dir=.*typo does not exist, so there is nothing to resume"
    ):
        loop.train(tiny_config(run), resume=True)
    assert train_main([*args(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume-or-start" in err and len(err.strip().splitlines()) == 1
    assert not run.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checkpoint": {"enabled": False}}, r"saved no checkpoints \(checkpoint.enabled=false\)"),
        ({"model": {"hidden": 32}}, r"holds a run of another model \(model.hidden=32 there, 64 here\)"),
    ],
    ids=["no-checkpoints", "other-model"],
)
def test_resume_never_writes_over_a_run_it_cannot_continue(tmp_path, change, message):
    run = tmp_path / "run"
    run.mkdir()
    saved = to_dict(tiny_config(run))
    for section, values in change.items():
        saved[section].update(values)
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(ConfigError, match=message):
        loop.train(tiny_config(run), resume=True)
    assert yaml.safe_load((run / "config.yaml").read_text()) == saved  # untouched
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    left = sorted(p.name for p in run.iterdir())
    assert left == ["config.yaml", "metrics.jsonl"]  # no empty checkpoints/ (issue 38)


class _Spy:
    """Records, for each step the loop runs, whether a save was still in flight."""

    def __init__(self, monkeypatch):
        self.ckpts: list[Checkpointer] = []
        self.steps: list[tuple[int, bool]] = []
        spy = self

        class Tracked(Checkpointer):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.in_flight = False
                spy.ckpts.append(self)

            def save(self, *a, **k):
                saved = super().save(*a, **k)
                self.in_flight = self.in_flight or saved
                return saved

            def wait(self):
                super().wait()
                self.in_flight = False

        class Step(loop.AdaptiveStep):
            def __call__(self, state, batch, step):
                spy.steps.append((step, spy.ckpts[-1].in_flight))
                return super().__call__(state, batch, step)

        monkeypatch.setattr(loop, "Checkpointer", Tracked)
        monkeypatch.setattr(loop, "AdaptiveStep", Step)


@pytest.mark.slow  # ~42 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_resume_in_an_empty_dir_starts_at_0_and_the_previous_save_is_done_before_the_next_is_due(
    tmp_path, monkeypatch, caplog, capsys, compile_cache
):
    run = tmp_path / "run"
    run.mkdir()  # e.g. made by the job script; nothing in it
    spy = _Spy(monkeypatch)
    with caplog.at_level(logging.INFO, logger="xmoe_jax"):
        result = loop.train(tiny_config(run), resume=True)
    assert f"no checkpoint in {run / 'checkpoints'}: starting at step 0" in caplog.text
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    every = tiny_config(run).checkpoint.every
    due = [s for s, in_flight in spy.steps if s % every == 0 and in_flight]
    assert not due, f"steps {due} ran while the previous save was in flight: a kill then loses 2 * every"

    # resumed once more: nothing to do, status 0
    again = loop.train(tiny_config(run), resume=True)
    assert again.already_finished and again.final_step == STEPS and not again.losses
    assert train_main([*args(run), "--resume"]) == 0
    assert f"already finished: step {STEPS} = train.steps" in capsys.readouterr().out
