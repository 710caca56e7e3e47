"""Model weights in and out of run directories, for the tools around the trainer.

Generation and `xmoe-convert export` read a run's weights (`load_weights`: the params and router
biases of one checkpoint step, restored onto any mesh, under the config that step was written with:
`RunDir.config_at`); `xmoe-convert import` writes weights made elsewhere as a run that
`xmoe-train --resume` continues (`save_initial`: step 0, a fresh optimizer state, the run's RNG,
the input position and the config, in the trainer's own checkpoint layout).
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import Mesh

from xmoe_jax.config import Config
from xmoe_jax.data import make_input
from xmoe_jax.train import state as tstate
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError
from xmoe_jax.train.rundir import RunDir


def load_weights(run_dir: str | Path, cfg: Config, step: int, mesh: Mesh) -> tuple[dict, dict]:
    """(params, bias) of the checkpoint at `step`, placed on `mesh` by cfg's rules. Only the weights
    are read (`tstate.restore_weights`): the optimizer moments would cost twice their memory."""
    layout = tstate.build(cfg, mesh)
    with RunDir(run_dir).checkpointer(cfg) as ckpt:
        return tstate.restore_weights(ckpt, layout, cfg.model.num_dense_layers, step)


def save_initial(cfg: Config, weights: tuple[dict, dict], mesh: Mesh) -> Path:
    """Writes `weights` (placed on `mesh`) as step 0 of the run `cfg.train.run_dir`, with its
    config.yaml: `xmoe-train --config <run_dir>/config.yaml --resume` continues from them."""
    run = RunDir(cfg.train.run_dir)
    if run.holds_run():
        raise CheckpointError(f"{run} already holds a run; choose a new output directory")
    state = tstate.build(cfg, mesh).init(cfg, mesh, weights=weights)
    num_processes = jax.process_count()
    data_iter = make_input(
        cfg.data,
        seq_len=cfg.train.seq_len,
        batch_size=cfg.train.batch_size // num_processes,
        vocab_size=cfg.model.vocab_size,
        process_index=jax.process_index(),
        process_count=num_processes,
        holdout=cfg.eval.holdout,
    )
    run.root.mkdir(parents=True, exist_ok=True)
    with Checkpointer(run.checkpoints, cfg.checkpoint) as ckpt:
        ckpt.save(0, state.as_dict(), data_iter, cfg, force=True)
    if jax.process_index() == 0:
        run.write_config(cfg)
    return run.root
