"""The train state: one dataclass shared by the step, the loop and the checkpoints.

    step    int32 []             optimizer steps applied
    params  Param pytree         float32 master weights (what the optimizer updates)
    bias    RouterBias pytree    selection-only router biases (aux-loss-free balancing)
    opt     optax state          moments follow their params' sharding
    rng     uint32 key data      `jax.random.key_data` (typed keys are not plain arrays to orbax)

Checkpoints hold `as_dict()` (the plain-dict layout every earlier version wrote), so
old checkpoints restore into this class unchanged.

`build(cfg, mesh)` is the one place a config becomes a train state's layout (model spec ->
optimizer -> shardings); `StateLayout.init` makes step 0 and `restore` reads a checkpoint into it,
layouts written before layer stacks included. The trainer, the evaluator, the weights tools (HF
export, generation, import) and the planner all start here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xmoe_jax.config import Config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.train import layout
from xmoe_jax.train.optimizer import make_optimizer

if TYPE_CHECKING:  # resume.py imports orbax; the planner and the lowering tools build states without it
    from xmoe_jax.train.resume import Candidates

log = logging.getLogger("xmoe_jax")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: Any
    params: Any
    bias: Any
    opt: Any
    rng: Any

    def as_dict(self) -> dict:
        """The checkpoint layout."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, tree: dict) -> TrainState:
        return cls(**tree)

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


def state_shardings(spec: fmodel.ModelSpec, optimizer, mesh: Mesh, fsdp: bool = False) -> TrainState:
    """NamedShardings of the whole train state; optimizer moments follow their params."""
    params_sh, bias_sh = fmodel.shardings(spec, mesh, fsdp)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shape = jax.eval_shape(optimizer.init, spec.params_shape)
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, params_sh, transform_non_params=lambda _: replicated
    )
    return TrainState(step=replicated, params=params_sh, bias=bias_sh, opt=opt_sh, rng=replicated)


def abstract_state(spec: fmodel.ModelSpec, optimizer, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the train state: restore targets."""
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=spec.params_shape,
        bias=spec.bias_shape,
        opt=jax.eval_shape(optimizer.init, spec.params_shape),
        rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    )
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_state(
    spec: fmodel.ModelSpec, optimizer, cfg: Config, mesh: Mesh, shardings: TrainState, weights=None
) -> TrainState:
    """Step 0: fresh weights (or the given (params, bias), already placed: an imported model), a
    fresh optimizer state and the run's RNG."""
    key = jax.random.key(cfg.train.seed)
    init_key, rng = jax.random.split(key)
    if weights is None:
        params, bias = fmodel.init_params(spec, init_key, mesh, cfg.mesh.fsdp)
    else:
        params, bias = weights
    opt = jax.jit(optimizer.init, out_shardings=shardings.opt)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    rng = jax.device_put(jax.random.key_data(rng), shardings.rng)
    return TrainState(step=step, params=params, bias=bias, opt=opt, rng=rng)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a train state is for one config on one mesh."""

    spec: fmodel.ModelSpec
    optimizer: Any  # optax.GradientTransformation
    shardings: TrainState  # of NamedSharding

    def abstract(self) -> TrainState:
        """ShapeDtypeStructs with their shardings: what restores and lowering target."""
        return abstract_state(self.spec, self.optimizer, self.shardings)

    def init(self, cfg: Config, mesh: Mesh, weights=None) -> TrainState:
        """Step 0 (`init_state`): fresh or given (params, bias)."""
        return init_state(self.spec, self.optimizer, cfg, mesh, self.shardings, weights=weights)


def build(cfg: Config, mesh: Mesh) -> StateLayout:
    """The train state's layout for `cfg` (placement resolved: `resolve.resolve_placement`) on `mesh`."""
    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    return StateLayout(spec, optimizer, state_shardings(spec, optimizer, mesh, cfg.mesh.fsdp))


def _read(ckpt, state: StateLayout, num_dense_layers: int, steps, data_iter, target: dict, partial: bool):
    """(step, the checkpoint's tree for `target`, whether it was written one subtree per layer)."""
    first = steps if isinstance(steps, int) else steps.newest
    per_layer = layout.is_per_layer(ckpt.saved_state_paths(first))
    if per_layer:
        target = layout.per_layer_target(target, num_dense_layers)
    if isinstance(steps, int):
        step, tree = steps, ckpt.restore(target, data_iter, steps, partial=partial)
    else:
        step, tree = steps.restore_first_intact(ckpt, target, data_iter)
    if per_layer:
        log.info(
            "checkpoint step %d has one subtree per layer (written before layer stacks): stacked on restore",
            step,
        )
        tree = layout.stack_per_layer(tree, num_dense_layers)
    return step, tree, per_layer


def restore(ckpt, state: StateLayout, num_dense_layers: int, steps: int | Candidates, data_iter=None):
    """(step, TrainState) read from `ckpt` (a `Checkpointer`) onto `state`'s shardings.

    `steps` the trainer's resume `Candidates` (newest first): the newest that restores intact,
    damaged newer ones set aside, the data iterator restored with it. `steps` an int (the tools):
    exactly that step, nothing moved. A checkpoint with one subtree per layer (written before layer
    stacks) is read into the stacks."""
    target = state.abstract().as_dict()
    step, tree, per_layer = _read(ckpt, state, num_dense_layers, steps, data_iter, target, partial=False)
    if not per_layer:
        return step, TrainState.from_dict(tree)
    return step, jax.device_put(TrainState.from_dict(tree), state.shardings)


def restore_weights(ckpt, state: StateLayout, num_dense_layers: int, step: int) -> tuple[Any, Any]:
    """(params, bias) of checkpoint `step` onto `state`'s shardings: the optimizer moments (twice
    the weights' bytes) are neither read nor allocated (`Checkpointer.restore(partial=True)`)."""
    abstract = state.abstract()
    target = {"params": abstract.params, "bias": abstract.bias}
    _, tree, per_layer = _read(ckpt, state, num_dense_layers, step, None, target, partial=True)
    if per_layer:
        tree = jax.device_put(tree, {"params": state.shardings.params, "bias": state.shardings.bias})
    return tree["params"], tree["bias"]
