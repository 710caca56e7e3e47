"""Tensor parallelism: config checks, TP/SP in the model, and SSMB's memory, on 8 fake CPU devices.

The MoE layer under every TP layout (TP in {1, 2, 4}; SSMB on and off, dropping per token shard,
the sequence-wise loss across tensor ranks; expert-TP; the auto-sharded paths) against the dense
oracle: tests/test_dispatch_oracle.py. Here: the whole model under TP/SP equals it without a mesh;
SSMB's dispatch/combine bytes fall by the TP factor, in the analytic model exactly and in the
compiled temp bytes, and the model is within 10% of the compiled figure.

Layer: T=64 tokens, D=16, F=16, E=8, top-2, gated shared expert, float32. Compiled
functions are cached per (config, layout).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from reference import rel_err

from xmoe_jax.config import Config, ConfigError, MeshConfig, MeshShape, ModelConfig, MoEConfig, ParallelConfig
from xmoe_jax.model import functional as fmodel
from xmoe_jax.moe import init_moe_params, moe_layer
from xmoe_jax.perf import memory_model as mm
from xmoe_jax.sharding import make_mesh
from xmoe_jax.train.step import stack_layers

T, D, F, S = 64, 16, 16, 16  # S: tokens per sequence
TOL = 1e-5

CFG = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, num_shared_experts=1, shared_expert_gate=True)
PFT, DENSE = ParallelConfig(dispatch="pft"), ParallelConfig(dispatch="dense")


@functools.cache
def _mesh(layout: tuple):
    return make_mesh(MeshConfig(*layout))


def test_config_validation_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="alternatives"):
        ParallelConfig(ssmb=True, expert_tensor_parallel=True)
    with pytest.raises(ConfigError, match="auto_shard"):
        ParallelConfig(dispatch="padded", auto_shard=True)
    etp = ModelConfig(moe=MoEConfig(expert_hidden=10))
    with pytest.raises(ConfigError, match="expert_hidden=10 is not divisible by mesh.tensor=4"):
        Config(model=etp, mesh=MeshConfig(tensor=4), parallel=ParallelConfig(expert_tensor_parallel=True))
    ssmb = Config(model=ModelConfig(), mesh=MeshConfig(tensor=8), parallel=ParallelConfig(ssmb=True))
    ssmb = dataclasses.replace(ssmb, train=dataclasses.replace(ssmb.train, batch_size=1, seq_len=12))
    with pytest.raises(ConfigError, match="ssmb: the 12 tokens"):
        ssmb.validate_for_devices(8)
    sp = dataclasses.replace(ssmb, parallel=dataclasses.replace(ssmb.parallel, sequence_parallel=True))
    with pytest.raises(ConfigError, match="sequence_parallel splits each sequence"):
        sp.validate_for_devices(8)


# ----------------------------------------------------------------------------- model: TP / SP


@functools.cache
def _model_fn(cfg: ModelConfig, par: ParallelConfig, layout: tuple | None):
    spec = fmodel.model_spec(cfg, par)
    mesh = None if layout is None else _mesh(layout)
    tokens = jax.random.randint(jax.random.key(3), (4, S), 0, cfg.vocab_size)

    def loss(params, bias):
        logits, stats = fmodel.apply(spec, params, bias, tokens)
        return jnp.mean(logits**2) + stack_layers(stats).aux_loss.sum(), logits

    params, bias = fmodel.init_params(spec, jax.random.key(0), mesh)
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if mesh is None:
        (_, logits), grads = fn(params, bias)
    else:
        with jax.set_mesh(mesh):
            (_, logits), grads = fn(params, bias)
    return logits, grads


MODEL = ModelConfig(
    vocab_size=64, hidden=D, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=32, num_dense_layers=1,
    dtype="float32", moe=CFG,
)  # fmt: skip


@pytest.mark.parametrize(
    "sp", [pytest.param(False, marks=pytest.mark.slow), True], ids=["tp", "tp+sp"]
)  # tp alone ~44 s: slow; tp+sp (the SSMB path) stays in the default suite
def test_model_tensor_parallel_equals_no_mesh(sp: bool) -> None:
    """Heads / MLP F over tensor=4 (GQA: 2 kv heads replicated), SSMB MoE; with and without SP."""
    logits_ref, grads_ref = _model_fn(MODEL, DENSE, None)
    logits, grads = _model_fn(
        MODEL, ParallelConfig(dispatch="pft", ssmb=True, sequence_parallel=sp), (2, 1, 4)
    )
    assert rel_err(logits, logits_ref) < TOL
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref), strict=True
    ):
        assert rel_err(a, b) < 1e-4, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- memory

SMALL = MoEConfig(num_experts=16, top_k=6, expert_hidden=128, activation="gelu")
SSMB = ParallelConfig(dispatch="pft", ssmb=True)
SMALL_D, SMALL_T = 256, 2048


@functools.cache
def _temp_bytes(cfg: MoEConfig, par: ParallelConfig, dim: int, tokens: int, layout: tuple) -> int:
    """Compiled temp bytes per device of jit(grad(sum(y) + aux_loss)) of one layer, float32."""
    mesh = _mesh(layout)
    params = jax.eval_shape(lambda: init_moe_params(jax.random.key(0), dim, cfg))

    def loss(p, x):
        y, aux = moe_layer(p, x, cfg, par, mesh=mesh)
        return jnp.sum(y) + aux.aux_loss

    x = jax.ShapeDtypeStruct((tokens, dim), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _sizes(layout):
    data, expert, tensor = layout
    return MeshShape(data=data, expert_nodes=1, expert_per_node=expert, tensor=tensor)


def test_ssmb_divides_dispatch_and_combine_bytes_by_tp() -> None:
    layout, tp = (1, 2, 4), 4
    est_on = mm.pft_estimate(SMALL, SSMB, SMALL_D, SMALL_T, _sizes(layout), itemsize=4)
    est_off = mm.pft_estimate(SMALL, PFT, SMALL_D, SMALL_T, _sizes(layout), itemsize=4)
    assert est_off.dispatch_combine == tp * est_on.dispatch_combine
    assert est_off.shapes.recv == tp * est_on.shapes.recv
    ratio = _temp_bytes(SMALL, PFT, SMALL_D, SMALL_T, layout) / _temp_bytes(
        SMALL, SSMB, SMALL_D, SMALL_T, layout
    )
    assert 0.9 * tp <= ratio <= tp, ratio  # all but the expert weights scale with the tokens


MEMORY_CASES = [
    # (name, cfg, parallel, dim, tokens, layout)
    ("tiny-ssmb", dataclasses.replace(CFG, num_shared_experts=0), SSMB, D, T, (2, 2, 2)),
    ("tiny", dataclasses.replace(CFG, num_shared_experts=0), PFT, D, T, (2, 4, 1)),
    ("small-ssmb", SMALL, SSMB, SMALL_D, SMALL_T, (1, 2, 4)),
    ("small-ep8", SMALL, PFT, SMALL_D, SMALL_T, (1, 8, 1)),
]


@pytest.mark.parametrize(
    "name, cfg, par, dim, tokens, layout", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES]
)
def test_memory_model_within_10_percent_of_compiled(name, cfg, par, dim, tokens, layout) -> None:
    est = mm.pft_estimate(cfg, par, dim, tokens, _sizes(layout), itemsize=4)
    measured = _temp_bytes(cfg, par, dim, tokens, layout)
    assert mm.relative_error(est.peak, measured) < 0.10, (name, est.peak_stage, est.peak, measured)
