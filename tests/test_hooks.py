"""The loop's hooks (train/hooks.py): each runs at its cadence, in registration order, and a step
is checked before a hook that needs it good (log, save, stop) sees it. Stubs only: nothing compiles."""

from __future__ import annotations

import contextlib
import types

import pytest

from xmoe_jax.config import load_config
from xmoe_jax.train import hooks
from xmoe_jax.train.errors import TrainingError


class _Meter:
    def read(self):
        return {"tokens_per_s": 1.0}

    def reset(self):
        pass

    @contextlib.contextmanager
    def paused(self):
        yield


class _Logger:
    def __init__(self):
        self.logged = []

    def log(self, record, eta_s=None):
        self.logged.append(record)


class _Ckpt:
    def __init__(self, every, calls):
        self.cfg = types.SimpleNamespace(every=every, enabled=True)
        self.calls, self.saved = calls, []

    def wait(self):
        self.calls.append("wait")

    def due(self, step, force):
        return force or step % self.cfg.every == 0

    def save(self, step, state, data_iter, cfg, force=False):
        self.calls.append(f"save {step}")
        self.saved.append(step)

    def latest_step(self):
        return self.saved[-1] if self.saved else None


class _Evaluator:
    def __init__(self, every, calls):
        self.every, self.calls = every, calls

    def due(self, step, last):
        return step % self.every == 0 or step == last

    def run(self, state, step):
        self.calls.append(f"eval {step}")
        return {"step": step, "eval_loss": 1.0}


class _Stop:
    def __init__(self, at):
        self.at = at

    def stop_now(self, step):
        return step == self.at

    def stop(self, step, ckpt, state, data_iter, cfg):
        ckpt.save(step, state, data_iter, cfg, force=True)
        return KeyboardInterrupt(f"stopped after {step}")


class _Profiler:
    def before_step(self, step):
        pass

    def after_step(self, step, metrics):
        pass

    def close(self):
        pass


def _metrics(loss=2.0, finite=True):
    return {"loss": loss, "finite": finite, "ce": loss, "aux_loss": 0.0, "z_loss": 0.0, "grad_norm": 1.0}


def _drive(cfg, registered, loop, steps):
    """The loop's schedule of hook calls (loop._run without the step)."""
    for step in steps:
        for hook in registered:
            hook.before_step(loop, step)
        metrics = _metrics(loss=float(step))
        loop.dispatched(step, metrics)
        for hook in registered:
            if hook.due(loop, step):
                hook.after_step(loop, step, metrics)
    loop.settle()


def _setup(*overrides, stop_at=None):
    cfg = load_config("configs/tiny.yaml", ["train.steps=6", "train.log_every=2", *overrides])
    calls: list[str] = []
    ckpt = _Ckpt(cfg.checkpoint.every, calls)
    state = types.SimpleNamespace(as_dict=dict)
    loop = hooks.Loop(cfg, state, None, ckpt, _Meter(), _Logger())
    registered = hooks.standard(cfg, ckpt, _Stop(stop_at), _Evaluator(3, calls), _Profiler(), None)
    return cfg, loop, registered, calls, ckpt


def test_hooks_run_at_their_cadence_in_order():
    cfg, loop, registered, calls, ckpt = _setup("checkpoint.every=4")
    assert [type(h).__name__ for h in registered] == [
        "ProfileHook",
        "LogHook",
        "EvalHook",
        "SaveHook",
        "StopHook",
    ]
    _drive(cfg, registered, loop, range(1, 7))
    assert [r["step"] for r in loop.records] == [2, 4, 6]  # train.log_every=2
    assert [r["step"] for r in loop.logger.logged] == [2, 3, 4, 6, 6]  # records and eval records
    # the wait before a due save, then saves every 4 and at the last step; evals every 3 and the last
    assert calls == ["eval 3", "wait", "save 4", "wait", "eval 6", "save 6"]
    assert loop.losses == {s: float(s) for s in range(1, 7)} and loop.pending is None


def test_a_step_is_checked_before_it_is_saved_or_stopped_at():
    cfg, loop, registered, calls, ckpt = _setup("checkpoint.every=100", stop_at=3)
    with pytest.raises(KeyboardInterrupt, match="stopped after 3"):
        _drive(cfg, registered, loop, range(1, 7))
    assert ckpt.saved == [3] and 3 in loop.losses  # settled before the stop's save

    cfg, loop, registered, calls, ckpt = _setup("checkpoint.every=100", "train.log_every=100")
    loop.dispatched(1, _metrics(finite=False))
    with pytest.raises(TrainingError, match="non-finite loss .* at step 1.*no checkpoint saved yet"):
        registered[-1].after_step(loop, 1, {})  # the stop hook settles step 1 first
