"""End-to-end trainer tests on the tiny model (CPU, 8 fake devices)."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from xmoe_jax.cli import params_main, train_main
from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.train.checkpoint import CheckpointError
from xmoe_jax.train.loop import TrainingError, train

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
TEXT = REPO / "data" / "tinyshakespeare.txt"  # shipped (data/README.md)


def tiny(run_dir, *overrides):
    return load_config(TINY, [f"train.run_dir={run_dir}", "train.log_every=1", *overrides])


# A small, fixed recipe shared by the resume tests: expert parallel, dropping padded dispatch,
# sigmoid routing with the aux-loss-free bias update, so resume covers every piece of state.
EP = [
    "mesh.data=2",
    "mesh.expert=4",
    "parallel.dispatch=padded",
    "model.moe.capacity_factor=1.0",
    "model.moe.score_func=sigmoid",
    "model.moe.bias_update_rate=0.01",
    "checkpoint.every=3",
    "checkpoint.async_save=true",
]


@pytest.mark.slow  # ~32 s; exact resume in the default run: test_preemption.py (SIGINT)
def test_resume_is_exact(tmp_path):
    full = train(tiny(tmp_path / "full", "train.steps=6", *EP))
    first = train(tiny(tmp_path / "split", "train.steps=3", *EP))
    assert sorted(first.losses) == [1, 2, 3]
    second = train(tiny(tmp_path / "split", "train.steps=6", *EP), resume=True)
    assert sorted(second.losses) == [4, 5, 6]
    resumed = {**first.losses, **second.losses}
    assert resumed == full.losses  # bitwise: same data position, state, RNG and bias
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run with its checkpoint (the tests below only try to start over it)."""
    run = tmp_path_factory.mktemp("two_steps") / "run"
    train(tiny(run, "train.steps=2", "checkpoint.every=2"))
    return run


def test_existing_run_dir_is_never_overwritten(two_step_run):
    run = two_step_run
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="--resume"):
        train(tiny(run, "train.steps=4"))
    after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert before == after


def test_incompatible_checkpoint_is_refused_before_compiling(two_step_run):
    run = two_step_run
    with pytest.raises(CheckpointError, match="model.hidden"):
        train(tiny(run, "train.steps=4", "model.hidden=32", "model.head_dim=8"), resume=True)


def test_nan_stops_with_clear_message_and_keeps_state(tmp_path):
    with pytest.raises(TrainingError, match="non-finite loss") as err:
        train(
            tiny(
                tmp_path / "nan",
                "train.steps=8",
                "optimizer.lr=1e30",
                "optimizer.warmup_steps=0",
                "optimizer.grad_clip=null",
                "checkpoint.enabled=false",
            )
        )
    assert "nan_policy=skip" in str(err.value)


@pytest.mark.slow  # ~28 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_nan_skip_policy_completes(tmp_path):
    result = train(
        tiny(
            tmp_path / "skip",
            "train.steps=6",
            "optimizer.lr=1e30",
            "optimizer.warmup_steps=0",
            "optimizer.grad_clip=null",
            "train.nan_policy=skip",
            "checkpoint.enabled=false",
        )
    )
    assert sorted(result.losses) == [1, 2, 3, 4, 5, 6]
    assert result.skipped and result.skipped[-1] == 6  # once parameters blow up, every step is refused


@pytest.mark.slow  # ~42 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_step_refuses_a_non_finite_update_with_finite_loss():
    """The step guard alone (one compiled step): lr=inf makes the first update NaN (0 * inf) while
    loss and gradient norm are finite; the step is marked not finite and the params stay."""
    import trainer_parts

    cfg = tiny("unused", "train.nan_policy=skip")
    object.__setattr__(cfg.optimizer, "lr", float("inf"))  # past validation, which refuses it
    tokens = np.arange(cfg.train.batch_size * cfg.train.seq_len, dtype=np.int32).reshape(8, -1) % 256
    state, metrics = trainer_parts.one_step(cfg, tokens, tokens)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert not bool(metrics["finite"])
    initial = trainer_parts.build(cfg).state
    for new, old in zip(jax.tree.leaves(state.params), jax.tree.leaves(initial.params), strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


@pytest.mark.slow  # ~30 s (2 min on a loaded machine): trains, saves and restores
def test_non_finite_update_with_finite_loss_never_reaches_params_or_checkpoints(tmp_path):
    """Issue 23, 2.2: with lr=inf the warmup's first lr is 0 * inf = NaN while the loss and the
    gradient norm are finite. Config validation now refuses lr=inf (test_configs.py); here it is
    forced past validation to show the step guard refuses the NaN update on its own."""
    cfg = tiny(
        tmp_path / "inf",
        "train.steps=2",
        "train.nan_policy=skip",
        "checkpoint.every=1",
        "checkpoint.async_save=false",
    )
    object.__setattr__(cfg.optimizer, "lr", float("inf"))
    result = train(cfg)
    assert result.skipped == [1, 2] and all(np.isfinite(v) for v in result.losses.values())
    from xmoe_jax.sharding import make_mesh
    from xmoe_jax.train import state as tstate
    from xmoe_jax.train.checkpoint import Checkpointer

    abstract = tstate.build(cfg, make_mesh(cfg.mesh)).abstract().as_dict()
    with Checkpointer(tmp_path / "inf" / "checkpoints", cfg.checkpoint) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        for step in (1, 2):
            state = ckpt.restore(abstract, None, step)
            for leaf in jax.tree.leaves((state["params"], state["opt"])):
                assert np.isfinite(np.asarray(leaf, np.float32)).all(), f"non-finite leaf at step {step}"


@pytest.mark.slow  # ~30 s: two short runs
def test_resume_with_another_state_dtype_casts_the_moments(tmp_path):
    run = tmp_path / "run"
    train(tiny(run, "train.steps=2", "checkpoint.every=2", "checkpoint.async_save=false"))
    resumed = train(tiny(run, "train.steps=4", "optimizer.state_dtype=bfloat16"), resume=True)
    assert sorted(resumed.losses) == [3, 4] and not resumed.skipped


def test_bad_inputs_fail_before_compiling(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        train(tiny(tmp_path / "a", "data.source=text", f"data.path={tmp_path / 'missing.txt'}"))
    with pytest.raises(ConfigError, match="devices"):
        train(tiny(tmp_path / "b", "mesh.data=3", "mesh.expert=1"))
    with pytest.raises(ConfigError, match="batch_size"):
        train(tiny(tmp_path / "c", "train.batch_size=4", "mesh.data=8"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_reports_bad_config_in_one_line(tmp_path, capsys):
    assert train_main(["--config", str(TINY), "--set", "model.moe.topk=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key model.moe.topk" in err[0]
    assert train_main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_params_cli_prints_table(capsys):
    assert params_main(["--config", str(REPO / "configs" / "small.yaml")]) == 0
    out = capsys.readouterr().out
    assert "paper units" in out and "10.06" in out


@pytest.mark.slow  # ~45 s; text training in the default run: test_data, test_run_tokenizer; whole: the README walkthrough
def test_loss_falls_on_text_with_metrics_file(tmp_path):
    run = tmp_path / "text"
    cfg = tiny(
        run,
        "data.source=text",
        f"data.path={TEXT}",
        "train.steps=60",
        "train.log_every=20",
        "checkpoint.enabled=false",
        "mesh.data=4",
        "mesh.expert=2",
        "parallel.dispatch=padded",
    )
    result = train(cfg)
    start, last = result.losses[1], result.records[-1]["loss"]
    assert start > 5.0 and last < 3.3, (start, last)  # from ln(256) ~ 5.5 to clearly below uniform
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [20, 40, 60]
    for key in (
        "loss",
        "tokens_per_s",
        "tflops_per_device",
        "expert_imbalance",
        "drop_rate",
        "lr",
        "grad_norm",
    ):
        assert key in lines[-1]
    assert len(lines[-1]["expert_imbalance"]) == cfg.model.num_moe_layers
    assert (run / "config.yaml").exists()


@pytest.mark.slow  # ~44 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_router_bias_moves_only_by_the_balancing_rule(tmp_path):
    cfg = tiny(
        tmp_path / "bias",
        "train.steps=3",
        "model.moe.score_func=sigmoid",
        "model.moe.bias_update_rate=0.05",
        "checkpoint.every=3",
    )
    train(cfg)
    from xmoe_jax.config import MeshConfig
    from xmoe_jax.sharding import make_mesh
    from xmoe_jax.train import state as tstate
    from xmoe_jax.train.checkpoint import Checkpointer
    from xmoe_jax.train.state import TrainState

    layout = tstate.build(cfg, make_mesh(MeshConfig(data=8)))
    with Checkpointer(tmp_path / "bias" / "checkpoints", cfg.checkpoint) as ckpt:
        state = TrainState.from_dict(ckpt.restore(layout.abstract().as_dict()))
        weights = tstate.restore_weights(ckpt, layout, cfg.model.num_dense_layers, 3)  # no optimizer
    for got, want in zip(jax.tree.leaves(weights), jax.tree.leaves((state.params, state.bias)), strict=True):
        assert got.sharding == want.sharding and np.array_equal(np.asarray(got), np.asarray(want))
    biases = list(state.bias["moe_layers"]["moe"]["router"]["bias"])  # one [E] row per MoE layer
    for b in biases:  # three sign steps of 0.05 each: every entry is a multiple of 0.05 within 0.15
        b = np.asarray(b)
        assert np.allclose(np.round(b / 0.05) * 0.05, b, atol=1e-6) and np.abs(b).max() <= 0.15 + 1e-6
        assert np.abs(b).max() > 0
    # the optimizer never sees the bias: no leaf of its state has the bias' shape path
    flat = jax.tree_util.tree_flatten_with_path(state.opt)[0]
    assert not any("bias" in jax.tree_util.keystr(path) for path, _ in flat)


# Placement is not the model: a run trained with rbd resumes under pft or padded and its losses go on
# as the uninterrupted rbd run's (dropless, so every dispatch computes the same function).
PLACED = [
    "mesh.data=2",
    "mesh.expert=4",
    "mesh.expert_nodes=2",
    "checkpoint.every=2",
    "checkpoint.async_save=false",
]


@pytest.fixture(scope="module")
def rbd_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    full = train(tiny(root / "full", "train.steps=4", *PLACED, "parallel.dispatch=rbd"))
    return root, full


@pytest.mark.slow  # ~180 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
@pytest.mark.parametrize("second", ["pft", pytest.param("padded", marks=pytest.mark.slow)])
def test_resume_under_another_dispatch_mode(rbd_run, second):
    root, full = rbd_run
    run = root / f"split-{second}"
    train(tiny(run, "train.steps=2", *PLACED, "parallel.dispatch=rbd"))
    resumed = train(tiny(run, "train.steps=4", *PLACED, f"parallel.dispatch={second}"), resume=True)
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert abs(resumed.losses[step] - full.losses[step]) < 1e-5 * abs(full.losses[step]), step


def test_the_skip_warning_does_not_suggest_skip(caplog):
    """Issue 38: with train.nan_policy=skip on, the warning still said "or set train.nan_policy=skip"."""
    from xmoe_jax.train import hooks

    for policy in ("skip", "stop"):
        run = hooks.Loop(tiny("unused", f"train.nan_policy={policy}"), *[None] * 5)
        caplog.clear()
        try:
            run.check(3, {"loss": float("nan"), "finite": False})
        except TrainingError as e:
            message = str(e)
        else:
            message = caplog.records[-1].getMessage()
        assert "non-finite loss (nan), gradient or update at step 3" in message
        assert ("set train.nan_policy=skip" in message) == (policy == "stop"), message
