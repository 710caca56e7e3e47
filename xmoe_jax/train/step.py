"""The jitted training step and the train state it updates.

State (a plain pytree, what checkpoints hold):
  step: int32 []; params: Param pytree (float32 masters); bias: RouterBias pytree;
  opt: optax state; rng: uint32 key data.

Loss = mean token cross-entropy
     + moe.aux_loss_weight * sum over MoE layers of the load-balance loss
     + moe.z_loss_weight   * sum over MoE layers of the router z-loss.
After the optimizer update, the aux-loss-free rule moves each layer's router bias by
`bias_update_rate * sign(mean_load - load_e)`. A step whose loss or gradient norm is
not finite leaves params, bias and optimizer state untouched (`finite` = False).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xmoe_jax import sharding
from xmoe_jax.config import Config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.moe.router import update_router_bias


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1).mean()


def _update_biases(bias: dict, tokens_per_expert_LE: jax.Array, rate: float) -> dict:
    """Applies the aux-loss-free update layer by layer (MoE layers in model order)."""
    if rate == 0 or not bias:
        return bias
    layers = dict(bias["layers"])
    for i, name in enumerate(sorted(layers)):
        node = layers[name]["moe"]["router"]
        new = update_router_bias(node["bias"], tokens_per_expert_LE[i], rate)
        layers[name] = {"moe": {"router": {"bias": new}}}
    return {**bias, "layers": layers}


def state_shardings(spec: fmodel.ModelSpec, optimizer, mesh: Mesh, fsdp: bool = False) -> dict:
    """NamedShardings of the whole train state; optimizer moments follow their params."""
    params_sh, bias_sh = fmodel.shardings(spec, mesh, fsdp)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shape = jax.eval_shape(optimizer.init, spec.params_shape)
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, params_sh, transform_non_params=lambda _: replicated
    )
    return {"step": replicated, "params": params_sh, "bias": bias_sh, "opt": opt_sh, "rng": replicated}


def abstract_state(spec: fmodel.ModelSpec, optimizer, shardings: dict) -> dict:
    """ShapeDtypeStructs (with shardings) of the train state: restore targets."""
    shapes = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": spec.params_shape,
        "bias": spec.bias_shape,
        "opt": jax.eval_shape(optimizer.init, spec.params_shape),
        "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    }
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_state(spec: fmodel.ModelSpec, optimizer, cfg: Config, mesh: Mesh, shardings: dict) -> dict:
    key = jax.random.key(cfg.train.seed)
    init_key, rng = jax.random.split(key)
    params, bias = fmodel.init_params(spec, init_key, mesh, cfg.mesh.fsdp)
    opt = jax.jit(optimizer.init, out_shardings=shardings["opt"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    rng = jax.device_put(jax.random.key_data(rng), shardings["rng"])
    return {"step": step, "params": params, "bias": bias, "opt": opt, "rng": rng}


def batch_sharding(mesh: Mesh, cfg: Config) -> NamedSharding:
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    return sharding.named_sharding(mesh, ("batch", "seq"), shape, sharding.ACTIVATION_RULES)


def make_train_step(spec: fmodel.ModelSpec, optimizer, cfg: Config, mesh: Mesh, shardings: dict):
    """jit(step)(state, batch) -> (state, metrics); the input state is donated."""
    moe = spec.cfg.moe
    aux_w = moe.aux_loss_weight if moe is not None else 0.0
    z_w = moe.z_loss_weight if moe is not None else 0.0
    bias_rate = moe.bias_update_rate if moe is not None else 0.0

    def loss_fn(params, bias, batch):
        logits_BSV, aux = fmodel.apply(spec, params, bias, batch["inputs"], mesh)
        ce = cross_entropy(logits_BSV, batch["targets"])
        aux_loss = aux["aux_loss"].sum() if aux else jnp.zeros(())
        z_loss = aux["z_loss"].sum() if aux else jnp.zeros(())
        return ce + aux_w * aux_loss + z_w * z_loss, (ce, aux_loss, z_loss, aux)

    def step(state: dict, batch: dict) -> tuple[dict, dict[str, Any]]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (ce, aux_loss, z_loss, aux)), grads = grad_fn(state["params"], state["bias"], batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        bias = _update_biases(state["bias"], aux["tokens_per_expert"], bias_rate) if aux else state["bias"]
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = {
            "step": state["step"] + 1,
            "params": keep(params, state["params"]),
            "bias": keep(bias, state["bias"]),
            "opt": keep(opt, state["opt"]),
            "rng": jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), 1)),
        }
        metrics = {
            "loss": loss,
            "ce": ce,
            "aux_loss": aux_loss,
            "z_loss": z_loss,
            "grad_norm": grad_norm,
            "finite": finite,
        }
        if aux:
            metrics["tokens_per_expert"] = aux["tokens_per_expert"]
            metrics["drop_rate"] = aux["drop_rate"]
            if "num_overflow" in aux:
                metrics["num_overflow"] = aux["num_overflow"].sum()
                metrics["recv_rows"] = aux["recv_rows"]
        return new_state, metrics

    data_sh = batch_sharding(mesh, cfg)
    return jax.jit(
        step,
        in_shardings=(shardings, {"inputs": data_sh, "targets": data_sh}),
        # metrics replicated: every process can read them (per-device loads span processes)
        out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
