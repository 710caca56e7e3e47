"""The trainer's pieces built the way the loop builds them, for tests that drive steps themselves."""

from __future__ import annotations

from typing import NamedTuple

import jax

from xmoe_jax.config import Config
from xmoe_jax.sharding import make_mesh
from xmoe_jax.train import state as tstate
from xmoe_jax.train.step import batch_sharding, make_train_step


class Parts(NamedTuple):
    mesh: object
    spec: object
    optimizer: object
    shardings: object
    state: object  # the initial TrainState
    batch_sharding: object


def build(cfg: Config) -> Parts:
    """Mesh, model spec, optimizer, state shardings and initial state of `cfg` (call under the mesh)."""
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        layout = tstate.build(cfg, mesh)
        state = layout.init(cfg, mesh)
    return Parts(mesh, layout.spec, layout.optimizer, layout.shardings, state, batch_sharding(mesh, cfg))


def one_step(cfg: Config, inputs, targets):
    """(state, metrics) after one train step of `cfg` from its initial state on (inputs, targets)."""
    p = build(cfg)
    with jax.set_mesh(p.mesh):
        batch = {
            "inputs": jax.device_put(inputs, p.batch_sharding),
            "targets": jax.device_put(targets, p.batch_sharding),
        }
        return make_train_step(p.spec, p.optimizer, cfg, p.mesh, p.shardings)(p.state, batch)
