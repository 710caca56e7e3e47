"""The GPU batches (scripts/gpu_bench_*.sh, scripts/bench_peers.sh) run as documented (issue 37
section 2): scripts/bench_train_step.py carries its --steps into the config before the load-time
checks read it, and every batch has a CPU dry run (DRY_RUN=1: tiny shapes, fake devices, few steps;
scripts/gpu_env.sh) in the slow suite, so a config change cannot break a batch unseen."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from xmoe_jax.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]


def _bench_train_step():
    spec = importlib.util.spec_from_file_location(
        "bench_train_step", REPO / "scripts" / "bench_train_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_train_step_checks_the_config_with_its_own_steps(monkeypatch):
    """gpu_bench_depth.sh's run: configs/small.yaml (train.steps=50) with --steps 100 and a trace of
    steps 60-61 was refused at load ("starts after the last step (train.steps=50)")."""
    bench = _bench_train_step()
    argv = ["--config", str(REPO / "configs" / "small.yaml"), "--steps", "100", "--log-every", "10",
            "--set", "train.profile_steps=[60,61]", "--set", "mesh.expert=4", "--set", "mesh.data=1"]  # fmt: skip
    loaded = []

    class Loaded(Exception):
        pass

    def first_load(path, overrides):
        loaded.append(load_config(path, overrides))  # the checks run here
        raise Loaded

    monkeypatch.setattr(bench, "load_config", first_load)
    monkeypatch.setattr(sys, "argv", ["bench_train_step.py", *argv])
    with pytest.raises(Loaded):
        bench.main()
    (cfg,) = loaded
    assert (cfg.train.steps, cfg.train.log_every, cfg.train.profile_steps) == (100, 10, (60, 61))
    assert not cfg.checkpoint.enabled
