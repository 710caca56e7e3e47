"""Model weights in and out of run directories, for the tools around the trainer.

Generation and `xmoe-convert export` read a run's weights (`read_run_config`, `load_weights`:
the config the checkpoint was written with, plus dotted overrides such as
`parallel.dispatch=dense`, and the params and router biases restored onto any mesh);
`xmoe-convert import` writes weights made elsewhere as a run that `xmoe-train --resume`
continues (`save_initial`: step 0, a fresh optimizer state, the run's RNG, the input
position and the config, in the trainer's own checkpoint layout).
"""

from __future__ import annotations

from pathlib import Path

import jax
import yaml
from jax.sharding import Mesh

from xmoe_jax.config import Config, from_dict, migrate_dict, override_dict, to_dict
from xmoe_jax.data import make_input
from xmoe_jax.model import functional as fmodel
from xmoe_jax.train import layout
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError
from xmoe_jax.train.optimizer import make_optimizer
from xmoe_jax.train.state import TrainState, abstract_state, init_state, state_shardings


def _checkpointer(run_dir: str | Path, cfg: Config | None = None) -> Checkpointer:
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(f"{run_dir} has no checkpoints/ directory; pass the train.run_dir of a run")
    return Checkpointer(directory, (cfg or Config()).checkpoint)


def read_run_config(run_dir: str | Path, step: int | None = None, overrides: list[str] | None = None):
    """(the run's Config at `step` (latest if None) with dotted `overrides` applied, the step)."""
    with _checkpointer(run_dir) as ckpt:
        step = ckpt.latest_step() if step is None else step
        saved = migrate_dict(ckpt.read_config(step))
    return from_dict(override_dict(saved, overrides)), step


def load_weights(run_dir: str | Path, cfg: Config, step: int, mesh: Mesh) -> tuple[dict, dict]:
    """(params, bias) of the checkpoint at `step`, placed on `mesh` by cfg's rules.

    The whole train state is restored (orbax restores what the target names; the optimizer
    moments cost twice the weights' memory for the moment)."""
    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    shardings = state_shardings(spec, optimizer, mesh, cfg.mesh.fsdp)
    target = abstract_state(spec, optimizer, shardings).as_dict()
    with _checkpointer(run_dir, cfg) as ckpt:
        if not layout.is_per_layer(ckpt.saved_state_paths(step)):
            state = ckpt.restore(target, None, step)
        else:  # written before layer stacks
            num_dense = cfg.model.num_dense_layers
            old = ckpt.restore(layout.per_layer_target(target, num_dense), None, step)
            state = jax.device_put(layout.stack_per_layer(old, num_dense), shardings.as_dict())
    return state["params"], state["bias"]


def save_initial(cfg: Config, weights: tuple[dict, dict], mesh: Mesh) -> Path:
    """Writes `weights` (placed on `mesh`) as step 0 of the run `cfg.train.run_dir`, with its
    config.yaml: `xmoe-train --config <run_dir>/config.yaml --resume` continues from them."""
    run_dir = Path(cfg.train.run_dir)
    if (run_dir / "checkpoints").exists() or (run_dir / "config.yaml").exists():
        raise CheckpointError(f"{run_dir} already holds a run; choose a new output directory")
    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    shardings = state_shardings(spec, optimizer, mesh, cfg.mesh.fsdp)
    state: TrainState = init_state(spec, optimizer, cfg, mesh, shardings, weights=weights)
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
    run_dir.mkdir(parents=True, exist_ok=True)
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint) as ckpt:
        ckpt.save(0, state.as_dict(), data_iter, cfg, force=True)
    if jax.process_index() == 0:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return run_dir
