"""The jitted training step.

Loss = mean token cross-entropy (chunked: model/loss.py)
     + moe.aux_loss_weight * sum over MoE layers of the load-balance loss
     + moe.z_loss_weight   * sum over MoE layers of the router z-loss
     + model.mtp_loss_weight * the multi-token prediction loss (with model.mtp_depth: the mean
       over depths, model/mtp.py; the MTP modules' MoE blocks count as MoE layers above).

With `train.micro_batch_size`, the global batch is cut into micro-batches inside the
jitted step (micro-batch m holds rows m, m+n, m+2n, ... so every device keeps an equal
share of each) and a scan adds their gradients in float32; the loss and gradients are
the means over micro-batches. Each micro-batch computes its own load-balance loss (as
Megatron and X-MoE do); the router-bias update uses the whole step's loads.

After the optimizer update, the aux-loss-free rule moves each MoE layer's router bias
by `bias_update_rate * sign(mean_load - load_e)`, matched to the layer by module path.
A step whose loss or gradient norm is not finite, or whose update could leave float32's range
(`optimizer.update_bound`: a NaN learning rate, a gradient too large for the moments), leaves
params, bias and optimizer state untouched (`finite` = False); nothing non-finite reaches the
params or a checkpoint (`optimizer.guarded_update`). The step runs
on the mesh it was made for.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xmoe_jax import sharding
from xmoe_jax.config import Config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.moe.dispatchers import exchanges_tokens
from xmoe_jax.moe.router import update_router_bias
from xmoe_jax.moe.stats import MoEStats, merge_micro
from xmoe_jax.train import weight_copy
from xmoe_jax.train.optimizer import guarded_update, update_bound
from xmoe_jax.train.state import TrainState


def update_router_biases(bias: dict, stats: dict[str, MoEStats], rate: float) -> dict:
    """The aux-loss-free update of every MoE layer's router bias; `stats` keyed by the MoE
    block's module path ("layers/layer_001/moe"), whose bias sits at <path>/router/bias."""
    if rate == 0 or not bias:
        return bias

    def update(node: dict, keys: list[str], load_E: jax.Array) -> dict:
        if not keys:
            return {**node, "bias": update_router_bias(node["bias"], load_E, rate)}
        return {**node, keys[0]: update(node[keys[0]], keys[1:], load_E)}

    for path, layer_stats in stats.items():
        bias = update(bias, [*path.split("/"), "router"], layer_stats.tokens_per_expert)
    return bias


def stack_layers(stats: dict[str, MoEStats]) -> MoEStats | None:
    """The statistics of every MoE layer in model order: [L, ...] leaves (stacks concatenated)."""
    if not stats:
        return None
    return jax.tree.map(lambda *a: jnp.concatenate(a), *(stats[k] for k in sorted(stats)))


def _micro_batches(batch: dict, num_micro: int) -> dict:
    """[B, S] -> [N, B/N, S]; micro-batch m takes rows m, m+N, ... (an equal share of every shard)."""
    return jax.tree.map(
        lambda a: a.reshape(a.shape[0] // num_micro, num_micro, *a.shape[1:]).swapaxes(0, 1), batch
    )


def batch_sharding(mesh: Mesh, cfg: Config) -> NamedSharding:
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    return sharding.named_sharding(mesh, ("batch", "seq"), shape, sharding.ACTIVATION_RULES)


def make_train_step(spec: fmodel.ModelSpec, optimizer, cfg: Config, mesh: Mesh, shardings: TrainState):
    """jit(step)(state, batch) -> (state, metrics); the input state is donated. Call it under
    `jax.set_mesh(mesh)` (the trainer does)."""
    moe = spec.cfg.moe
    aux_w = moe.aux_loss_weight if moe is not None else 0.0
    z_w = moe.z_loss_weight if moe is not None else 0.0
    bias_rate = moe.bias_update_rate if moe is not None else 0.0
    mtp_w = spec.cfg.mtp_loss_weight if spec.cfg.mtp_depth else 0.0

    data_sh = batch_sharding(mesh, cfg)
    dropless_exchange = (
        moe is not None and moe.capacity_factor is None and exchanges_tokens(spec.parallel.dispatch)
    )
    micro = cfg.train.micro_batch_size
    num_micro = cfg.train.batch_size // micro if micro else 1
    accum = jnp.dtype(cfg.train.grad_accum_dtype)  # the micro-batches' gradient sum
    bound = update_bound(cfg.optimizer, cfg.train.steps)  # the optimizer's own (train/state.build)

    def loss_fn(params, bias, batch):
        ce, mtp, stats = fmodel.loss_terms(spec, params, bias, batch["inputs"], batch["targets"])
        stacked = stack_layers(stats)
        aux_loss = stacked.aux_loss.sum() if stacked else jnp.zeros(())
        z_loss = stacked.z_loss.sum() if stacked else jnp.zeros(())
        total = ce + aux_w * aux_loss + z_w * z_loss
        if mtp_w:
            total = total + mtp_w * mtp
        return total, (ce, aux_loss, z_loss, mtp, stats)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulated(params, masters, bias, batch):
        """grad_fn over the micro-batches: means of losses and gradients (summed in `accum`, returned in
        the masters' dtypes), step statistics. One micro-batch: the gradients in `params`' dtypes."""
        if num_micro == 1:
            return grad_fn(params, bias, batch)

        def one(grads_acc, mb):
            mb = {k: jax.lax.with_sharding_constraint(v, data_sh) for k, v in mb.items()}
            (loss, aux), grads = grad_fn(params, bias, mb)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(accum), grads_acc, grads)
            return grads_acc, (loss, aux)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accum), params)
        grads, (loss_N, (ce_N, aux_N, z_N, mtp_N, stats_N)) = jax.lax.scan(
            one, zeros, _micro_batches(batch, num_micro)
        )
        grads = jax.tree.map(lambda g, p: (g.astype(jnp.float32) / num_micro).astype(p.dtype), grads, masters)
        stats = {k: merge_micro(v) for k, v in stats_N.items()}
        return (loss_N.mean(), (ce_N.mean(), aux_N.mean(), z_N.mean(), mtp_N.mean(), stats)), grads

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict[str, Any]]:
        # the model reads the compute-dtype copies where the state keeps them (train/weight_copy.py); their
        # gradients come in that dtype, as the GEMMs wrote them
        params = weight_copy.merged(state.params, state.weights)
        (loss, (ce, aux_loss, z_loss, mtp_loss, stats)), grads = accumulated(
            params, state.params, state.bias, batch
        )
        stacked = stack_layers(stats)
        # dropless: a step whose copies did not all fit the buffers is not a step at all (the
        # trainer reruns it with bigger buffers): nothing moves, not even the step count or RNG
        fits = stacked.num_overflow.sum() == 0 if dropless_exchange else jnp.ones((), bool)
        with jax.named_scope("optimizer"):  # a name the trace breakdown finds (perf/step_breakdown.py)
            params, opt, grad_norm, update_finite, weights = guarded_update(
                optimizer, state.params, state.opt, grads, jnp.isfinite(loss) & fits, bound, state.weights
            )
        finite = jnp.isfinite(loss) & update_finite
        ok = finite & fits
        bias = jax.tree.map(
            lambda n, o: jnp.where(ok, n, o), update_router_biases(state.bias, stats, bias_rate), state.bias
        )
        new_rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1))
        new_state = TrainState(
            step=jnp.where(fits, state.step + 1, state.step),
            params=params,
            bias=bias,
            opt=opt,
            rng=jnp.where(fits, new_rng, state.rng),
            weights=weights,
        )
        metrics = {
            "loss": loss,
            "ce": ce,
            "aux_loss": aux_loss,
            "z_loss": z_loss,
            "grad_norm": grad_norm,
            "finite": finite,
        }
        if mtp_w:
            metrics["mtp_loss"] = mtp_loss
        if stacked is not None:
            metrics["tokens_per_expert"] = stacked.tokens_per_expert
            metrics["drop_rate"] = stacked.drop_rate
            if stacked.num_overflow is not None:
                metrics["num_overflow"] = stacked.num_overflow.sum()
                metrics["recv_rows"] = stacked.recv_rows
                metrics["peak_ratio"] = stacked.peak_ratio.max()
                metrics["wire_bytes"] = stacked.wire_bytes  # [L, devices]
                metrics["routed_bytes"] = stacked.routed_bytes
                metrics["exchange_rows"] = stacked.exchange_rows  # [L, P, P]
        return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(shardings, {"inputs": data_sh, "targets": data_sh}),
        # metrics replicated: every process can read them (per-device loads span processes)
        out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
