"""The train state: one dataclass shared by the step, the loop and the checkpoints.

    step    int32 []             optimizer steps applied
    params  Param pytree         float32 master weights (what the optimizer updates)
    bias    RouterBias pytree    selection-only router biases (aux-loss-free balancing)
    opt     optax state          moments follow their params' sharding
    rng     uint32 key data      `jax.random.key_data` (typed keys are not plain arrays to orbax)
    weights params' structure    the compute-dtype copies of the params cast at every use, None
                                 leaves elsewhere (`train.weight_copy`, train/weight_copy.py); None: off

Checkpoints hold `as_dict()` (the plain-dict layout every earlier version wrote, without the
copies: init and restore make them from the params), so old checkpoints restore into this class
unchanged.

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
from xmoe_jax.train import layout, weight_copy
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
    weights: Any = None

    def as_dict(self) -> dict:
        """The checkpoint layout (no weight copies: they are made from the params)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "weights"}

    @classmethod
    def from_dict(cls, tree: dict) -> TrainState:
        return cls(**tree)

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


def state_shardings(
    spec: fmodel.ModelSpec, optimizer, mesh: Mesh, fsdp: bool = False, copy=None
) -> TrainState:
    """NamedShardings of the whole train state; optimizer moments and weight copies follow their params."""
    params_sh, bias_sh = fmodel.shardings(spec, mesh, fsdp)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shape = jax.eval_shape(optimizer.init, spec.params_shape)
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, params_sh, transform_non_params=lambda _: replicated
    )
    weights_sh = weight_copy.shardings(params_sh, spec.params_shape, copy)
    return TrainState(
        step=replicated, params=params_sh, bias=bias_sh, opt=opt_sh, rng=replicated, weights=weights_sh
    )


def abstract_state(spec: fmodel.ModelSpec, optimizer, shardings: TrainState, copy=None) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the train state: restore targets."""
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=spec.params_shape,
        bias=spec.bias_shape,
        opt=jax.eval_shape(optimizer.init, spec.params_shape),
        rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
        weights=weight_copy.copies(spec.params_shape, copy),
    )
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_state(
    spec: fmodel.ModelSpec,
    optimizer,
    cfg: Config,
    mesh: Mesh,
    shardings: TrainState,
    weights=None,
    copy=None,
) -> TrainState:
    """Step 0: fresh weights (or the given (params, bias), already placed: an imported model), a
    fresh optimizer state, the run's RNG and the weight copies in `copy` (None: none)."""
    key = jax.random.key(cfg.train.seed)
    init_key, rng = jax.random.split(key)
    if weights is None:
        params, bias = fmodel.init_params(spec, init_key, mesh, cfg.mesh.fsdp)
    else:
        params, bias = weights
    opt = jax.jit(optimizer.init, out_shardings=shardings.opt)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    rng = jax.device_put(jax.random.key_data(rng), shardings.rng)
    return with_copies(TrainState(step=step, params=params, bias=bias, opt=opt, rng=rng), shardings, copy)


def with_copies(state: TrainState, shardings: TrainState, copy) -> TrainState:
    """`state` with its params' compute-dtype copies made (none when copy is None)."""
    if copy is None:
        return state.replace(weights=None)
    make = jax.jit(lambda p: weight_copy.copies(p, copy), out_shardings=shardings.weights)
    return state.replace(weights=make(state.params))


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a train state is for one config on one mesh."""

    spec: fmodel.ModelSpec
    optimizer: Any  # optax.GradientTransformation
    shardings: TrainState  # of NamedSharding
    copy: Any = None  # the weight copies (train/weight_copy.Plan), None: none

    def abstract(self) -> TrainState:
        """ShapeDtypeStructs with their shardings: what restores and lowering target."""
        return abstract_state(self.spec, self.optimizer, self.shardings, self.copy)

    def init(self, cfg: Config, mesh: Mesh, weights=None) -> TrainState:
        """Step 0 (`init_state`): fresh or given (params, bias)."""
        return init_state(self.spec, self.optimizer, cfg, mesh, self.shardings, weights, self.copy)


def build(cfg: Config, mesh: Mesh) -> StateLayout:
    """The train state's layout for `cfg` (placement resolved: `resolve.resolve_placement`) on `mesh`."""
    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    copy = weight_copy.plan(cfg, mesh.size)
    return StateLayout(spec, optimizer, state_shardings(spec, optimizer, mesh, cfg.mesh.fsdp, copy), copy)


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
    restored = TrainState.from_dict(tree)
    if per_layer:
        restored = jax.device_put(restored, state.shardings.replace(weights=None))
    return step, with_copies(restored, state.shardings, state.copy)


def restore_weights(ckpt, state: StateLayout, num_dense_layers: int, step: int) -> tuple[Any, Any]:
    """(params, bias) of checkpoint `step` onto `state`'s shardings: the optimizer moments (twice
    the weights' bytes) are neither read nor allocated (`Checkpointer.restore(partial=True)`)."""
    abstract = state.abstract()
    target = {"params": abstract.params, "bias": abstract.bias}
    _, tree, per_layer = _read(ckpt, state, num_dense_layers, step, None, target, partial=True)
    if per_layer:
        tree = jax.device_put(tree, {"params": state.shardings.params, "bias": state.shardings.bias})
    return tree["params"], tree["bias"]
