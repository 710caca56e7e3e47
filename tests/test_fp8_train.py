"""FP8 in training (model.fp8): a tiny run with FP8 on tracks the same run without it, and a
checkpoint written without FP8 resumes with it (the parameters and optimizer state are the same
trees: FP8 changes how GEMMs run, not what is stored). CPU, 8 fake devices; the XLA oracle runs
the FP8 GEMMs here (fp8/gmm.py), so this checks the wiring and numerics, not speed."""

from __future__ import annotations

import math
import pathlib

import pytest

from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.train.loop import train

TINY = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
# pft dispatch: the routed experts run the grouped GEMM (gmm_fp8 with FP8 on)
BASE = ["parallel.dispatch=pft", "train.log_every=1", "checkpoint.every=2", "checkpoint.async_save=false"]
FP8 = "model.fp8={recipe: blockwise, grad_format: e4m3}"


def _cfg(run_dir, *overrides):
    return load_config(TINY, [f"train.run_dir={run_dir}", *BASE, *overrides])


def test_fp8_run_tracks_bf16_and_resumes_with_fp8_switched_on(tmp_path):
    off = train(_cfg(tmp_path / "off", "train.steps=2"))
    on = train(_cfg(tmp_path / "on", "train.steps=4", FP8))
    assert on.losses[1] != off.losses[1]  # the FP8 GEMMs did run
    for step in (1, 2):  # same seed, same data: FP8 moves the loss by a fraction of a percent
        assert math.isfinite(on.losses[step])
        assert abs(on.losses[step] - off.losses[step]) / off.losses[step] < 0.01, (
            step,
            on.losses,
            off.losses,
        )
    # the bf16 checkpoint at step 2 resumes with FP8 on
    resumed = train(_cfg(tmp_path / "off", "train.steps=4", FP8), resume=True)
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert math.isfinite(resumed.losses[step])
        assert abs(resumed.losses[step] - on.losses[step]) / on.losses[step] < 0.01


def test_fp8_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"model\.fp8\.recipe='delayed' is not one of"):
        load_config(TINY, ["model.fp8={recipe: delayed}"])
    with pytest.raises(ConfigError, match=r"model\.fp8=null"):
        load_config(TINY, ["model.fp8={projections: false, experts: false}"])
    with pytest.raises(ConfigError, match=r"unknown config key model\.fp8\.amax_history"):
        load_config(TINY, ["model.fp8={amax_history: 16}"])
    assert load_config(TINY, ["model.fp8=null"]).model.fp8 is None


def test_policy_covers_what_the_config_says():
    cfg = load_config(TINY, ["model.fp8={recipe: rowwise, experts: false}"]).model.fp8
    assert fp8_context.recipe_for("experts") is None
    with fp8_context.use(cfg):
        assert fp8_context.recipe_for("experts") is None
        assert fp8_context.recipe_for("projections").name == "rowwise"
    assert fp8_context.recipe_for("projections") is None
