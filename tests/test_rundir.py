"""A run on disk (issue 21 item 1): `RunDir` names every path, and the tools read the config of the
step they read. Before, `config.yaml` (written once, at the start) fed `xmoe-eval` and the tokenizer of
`xmoe-generate`, while the checkpoint's own config fed generation's model and `xmoe-convert export`:
after a resume that changed the config, the tools disagreed about what the run was."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import pytest

from xmoe_jax.config import CheckpointConfig, load_config
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError
from xmoe_jax.train.rundir import RunDir

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def test_every_path_of_a_run_is_under_its_root(tmp_path) -> None:
    run = RunDir(str(tmp_path))
    paths = [run.config, run.metrics, run.discarded_metrics, run.checkpoints, run.tokenizer]
    paths += [run.tensorboard, run.profile, run.plots, run.lock, run.hf_source_config]
    assert all(p.parent == tmp_path for p in paths) and len(set(paths)) == len(paths)
    assert str(run) == str(tmp_path) and not run.holds_run()


def test_config_at_is_the_config_the_step_was_written_under(tmp_path) -> None:
    run = RunDir(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoints/ directory"):
        run.config_at()
    first = load_config(TINY, ["model.moe.top_k=2", f"train.run_dir={tmp_path}"])
    resumed = load_config(TINY, ["model.moe.top_k=1", "train.steps=40", f"train.run_dir={tmp_path}"])
    run.write_config(first)  # written once, at the start
    with Checkpointer(run.checkpoints, CheckpointConfig(every=1, async_save=False)) as ckpt:
        ckpt.save(2, {"w": jnp.ones(4)}, None, first)
        ckpt.save(4, {"w": jnp.ones(4)}, None, resumed)
        ckpt.save(6, {"w": jnp.ones(4)}, None, None)  # no config saved: config.yaml stands in
    assert run.config_at(2)[0].model.moe.top_k == 2
    cfg, step = run.config_at(4)
    assert (step, cfg.model.moe.top_k, cfg.train.steps) == (4, 1, 40)
    cfg, step = run.config_at()  # the latest step, which saved none
    assert (step, cfg.model.moe.top_k) == (6, 2)
    cfg, _ = run.config_at(4, ["model.moe.top_k=2"])  # the user's overrides come last
    assert cfg.model.moe.top_k == 2 and cfg.train.run_dir == str(tmp_path)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 3 .* available steps are \[2, 4, 6\]"):
        run.config_at(3)


@pytest.mark.slow  # ~2 min: two trainings, then eval, generation and export at two steps
def test_eval_generate_and_export_read_the_config_of_their_step(tmp_path, capsys) -> None:
    from xmoe_jax.cli import eval_main, train_main
    from xmoe_jax.cli_models import generate_main
    from xmoe_jax.generate import generate_from_run
    from xmoe_jax.hf.convert import export_checkpoint
    from xmoe_jax.train.evaluate import evaluate_checkpoint

    run = tmp_path / "run"
    base = ["--config", str(ROOT / "configs" / "tiny_hf.yaml"), "--set", f"train.run_dir={run}"]
    base += ["--set", f"data.path={ROOT / 'data' / 'tinyshakespeare.txt'}"]
    base += [f"--set={s}" for s in ("checkpoint.every=2", "checkpoint.async_save=false", "eval.holdout=0.05")]
    base += ["--set=eval.steps=2", "--set=train.log_every=1"]
    assert train_main([*base, "--set=train.steps=2"]) == 0  # top_k 2 (config.yaml says so)
    assert (
        train_main(
            [
                *base,
                "--set=train.steps=4",
                "--set=model.moe.top_k=1",
                "--set=model.max_seq_len=128",
                "--resume",
            ]
        )
        == 0
    )

    def evaluate(*overrides):
        return evaluate_checkpoint(run, 4, list(overrides))["eval_loss"]

    assert evaluate() == evaluate("model.moe.top_k=1") != evaluate("model.moe.top_k=2")
    assert eval_main(["--run-dir", str(run)]) == 0
    assert f"eval loss {evaluate():.4f}" in capsys.readouterr().out

    # generation: the resume shortened model.max_seq_len to 128 (config.yaml says 256)
    argv = ["--run-dir", str(run), "--prompt", "First", "--max-tokens", "130"]
    assert generate_main(argv) == 2
    assert "model.max_seq_len=128" in capsys.readouterr().err
    prompt = [[70, 105, 114, 115, 116]]
    assert generate_from_run(str(run), prompt, 4, step=4) == generate_from_run(
        str(run), prompt, 4, step=4, overrides=["model.moe.top_k=1", "model.max_seq_len=128"]
    )

    for step, top_k in ((2, 2), (4, 1)):
        export_checkpoint(run, tmp_path / f"hf{step}", step)
        assert (
            json.loads((tmp_path / f"hf{step}" / "config.json").read_text())["num_experts_per_tok"] == top_k
        )
