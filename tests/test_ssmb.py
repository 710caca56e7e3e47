"""Tensor parallelism: SSMB, expert-TP, the auto-sharded paths and TP/SP in the model, on 8 fake CPU devices.

Equivalence: every TP layout (TP in {1, 2, 4}; SSMB on and off; expert-TP) gives the outputs
and gradients of the same layer on a TP=1 mesh (itself checked against the no-mesh dense
layer). Memory: SSMB's dispatch/combine bytes fall by the TP factor, in the analytic model
exactly and in the compiled temp bytes, and the model is within 10% of the compiled figure.

Layer: T=64 tokens, D=16, F=16, E=8, top-2, gated shared expert, float32. Compiled
functions are cached per (config, layout).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import keep_ref, rel_err

from xmoe_jax.config import Config, ConfigError, MeshConfig, MeshShape, ModelConfig, MoEConfig, ParallelConfig
from xmoe_jax.model import functional as fmodel
from xmoe_jax.moe import init_moe_params, moe_layer, router
from xmoe_jax.moe.dense import dense_dispatch
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.perf import memory_model as mm
from xmoe_jax.sharding import make_mesh
from xmoe_jax.train.step import stack_layers

T, D, F, S = 64, 16, 16, 16  # S: tokens per sequence (sequence-wise aux loss)
TOL = 1e-5

CFG = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, num_shared_experts=1, shared_expert_gate=True)
PFT, DENSE = ParallelConfig(dispatch="pft"), ParallelConfig(dispatch="dense")
TP1 = (2, 4, 1)  # (data, expert, tensor): the reference layout


@functools.cache
def _mesh(layout: tuple):
    return make_mesh(MeshConfig(*layout))


def _params(cfg: MoEConfig = CFG) -> dict:
    return init_moe_params(jax.random.key(1), D, cfg, std=0.2)


def _x() -> jax.Array:
    return jax.random.normal(jax.random.key(0), (T, D), jnp.float32)


def _proj() -> jax.Array:
    return jax.random.normal(jax.random.key(7), (T, D), jnp.float32)


@functools.cache
def _layer_fn(cfg: MoEConfig, par: ParallelConfig, layout: tuple | None):
    mesh = None if layout is None else _mesh(layout)

    def loss(p, x, proj):
        y, aux = moe_layer(p, x, cfg, par, mesh=mesh, seq_len=S)
        return jnp.sum(y * proj) + aux.aux_loss + 0.1 * aux.z_loss, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _run(cfg: MoEConfig, par: ParallelConfig, layout):
    (_, (y, aux)), (g_p, g_x) = _layer_fn(cfg, par, layout)(_params(cfg), _x(), _proj())
    return y, aux, g_p, g_x


def _assert_same(got, want, totals=("tokens_per_expert", "num_dropped", "aux_loss", "z_loss")) -> None:
    y, aux, g_p, g_x = got
    y_w, aux_w, g_p_w, g_x_w = want
    assert rel_err(y, y_w) < TOL
    assert rel_err(g_x, g_x_w) < TOL
    assert jax.tree.structure(g_p) == jax.tree.structure(g_p_w)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree.leaves(g_p_w), strict=True):
        assert rel_err(a, b) < TOL, jax.tree_util.keystr(path)
    for key in totals:
        np.testing.assert_allclose(np.asarray(getattr(aux, key)), np.asarray(getattr(aux_w, key)), rtol=TOL)


@functools.cache
def _reference(cfg: MoEConfig = CFG):
    """pft on the TP=1 mesh, checked once against the dense layer without a mesh."""
    ref = _run(cfg, PFT, TP1)
    _assert_same(ref, _run(cfg, DENSE, None))
    return ref


# ----------------------------------------------------------------------------- equivalence

TP_CASES = [
    # (layout (data, expert, tensor[, expert_nodes]), ParallelConfig overrides of pft)
    ((2, 4, 1), {"ssmb": True}),  # TP=1: SSMB is a no-op
    ((2, 2, 2), {}),  # TP=2, tokens replicated over tensor
    ((2, 2, 2), {"ssmb": True}),
    ((1, 2, 4), {}),  # TP=4
    ((1, 2, 4), {"ssmb": True}),
    ((2, 1, 4), {"ssmb": True}),  # TP=4, no expert parallelism: 8 tokens per device
    ((1, 2, 4), {"expert_tensor_parallel": True}),  # expert-TP: F/4 per rank
    # rbd, (data, expert, tensor, expert_nodes): any TP, with and without SSMB
    ((1, 4, 2, 2), {"dispatch": "rbd", "ssmb": True}),  # 2 nodes x 2, TP=2
    ((1, 2, 4, 2), {"dispatch": "rbd", "ssmb": True}),  # 2 single-device nodes, TP=4
    ((2, 2, 2, 2), {"dispatch": "rbd"}),  # TP=2, tokens replicated over tensor
]


@pytest.mark.parametrize("layout, over", TP_CASES, ids=[f"{m}-{'-'.join(o) or 'rep'}" for m, o in TP_CASES])
def test_tensor_parallel_layer_equals_tp1(layout, over) -> None:
    y, aux, g_p, g_x = got = _run(CFG, dataclasses.replace(PFT, **over), layout)
    _assert_same(got, _reference())
    # per-device received rows: one entry per token shard (tensor ranks are shards only under SSMB)
    recv = np.asarray(aux.recv_rows)
    assert recv.sum() == T * CFG.top_k
    assert recv.size == layout[0] * layout[1] * (layout[2] if over.get("ssmb") else 1)
    spec0 = y.sharding.spec[0] if y.sharding.spec else None
    tensor_split = "tensor" in (spec0 if isinstance(spec0, tuple) else (spec0,))
    assert tensor_split == (over.get("ssmb", False) and layout[2] > 1)  # SSMB: output stays split


def test_ssmb_sequence_loss_with_sequences_cut_across_tensor_ranks() -> None:
    """(2,1,4): a 16-token sequence spans 2 tensor ranks; the sequence-wise loss stays exact."""
    cfg = dataclasses.replace(CFG, aux_loss_type="sequence")
    want = _run(cfg, DENSE, None)
    _assert_same(_run(cfg, dataclasses.replace(PFT, ssmb=True), (2, 1, 4)), want)


def test_auto_sharded_paths_equal_tp1() -> None:
    """pft without shard_map (auto_shard) and padded, both with the SSMB token annotation."""
    for over in ({"auto_shard": True, "ssmb": True}, {"dispatch": "padded", "ssmb": True}):
        got = _run(CFG, dataclasses.replace(PFT, **over), (2, 2, 2))
        _assert_same(got, _reference())
        spec0 = got[0].sharding.spec[0]
        assert "tensor" in spec0, spec0


def test_ssmb_dropping_keeps_capacity_per_token_shard() -> None:
    """With capacity, SSMB shards are the capacity's source shards: T/(data*expert*tensor) tokens each."""
    cfg = dataclasses.replace(CFG, capacity_factor=1.0)
    layout, shards = (2, 2, 2), 8
    params, x, proj = _params(cfg), _x() + 1.0, _proj()  # shifted inputs: uneven loads, drops
    (_, (y, aux)), (g_p, _) = _layer_fn(cfg, dataclasses.replace(PFT, ssmb=True), layout)(params, x, proj)
    r = router.route(x, params["router"]["kernel"], None, cfg)
    idx, wts = np.asarray(r.topk_idx_TK), np.asarray(r.topk_weight_TK)
    t_loc = T // shards
    keep = np.concatenate(
        [
            keep_ref(idx[s : s + t_loc], wts[s : s + t_loc], cfg.num_experts, cfg.capacity(t_loc), "probs")
            for s in range(0, T, t_loc)
        ]
    )
    assert (~keep).sum() > 0 and int(aux.num_dropped) == (~keep).sum()

    def oracle(p, x):
        rr = router.route(x, p["router"]["kernel"], None, cfg)
        gate = rr.topk_weight_TK * jnp.asarray(keep, jnp.float32)
        y = dense_dispatch(x, rr.topk_idx_TK, gate, p["experts"], cfg.activation, lambda a, _: a)
        return y + shared_experts(x, p["shared"], cfg.activation)

    y_o, vjp = jax.vjp(oracle, params, x)
    assert rel_err(y, y_o) < TOL
    # expert weights only see sum(y * proj): the aux losses reach the router alone
    go_p, _ = vjp(proj)
    for part in ("experts", "shared"):
        for key, g in g_p[part].items():
            assert rel_err(g, go_p[part][key]) < TOL, (part, key)


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


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
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
