"""`moe_layer`: dense oracle vs a NumPy loop, padded vs dense (values and gradients), meshes.

T=64 tokens, D=16, F=32, float32. Compiled functions are cached per (config, mesh) so that
each variant compiles once per session.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import keep_ref, moe_ref, rel_err, route_ref

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer
from xmoe_jax.sharding import make_mesh

T, D, F = 64, 16, 32
TOL = 1e-5
DENSE, PADDED = ParallelConfig(dispatch="dense"), ParallelConfig(dispatch="padded")


def _x(seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (T, D), jnp.float32)


def _params(cfg: MoEConfig, seed: int = 1, skew: bool = False) -> dict:
    params = init_moe_params(jax.random.key(seed), D, cfg, std=0.2)
    if "bias" in params["router"]:
        bias = 0.1 * jax.random.normal(jax.random.key(seed + 100), (cfg.num_experts,))
        params["router"]["bias"] = bias
    if skew:
        # inputs have mean +1 per feature: experts 0 and 1 attract most tokens, 2 and 3 none
        kernel = params["router"]["kernel"]
        kernel = kernel.at[:, :2].add(0.15).at[:, 2:4].add(-1.0)
        params["router"]["kernel"] = kernel
    return params


def _skewed_x(seed: int = 0) -> jax.Array:
    return _x(seed) + 1.0


@functools.cache
def _mesh(data: int, expert: int, tensor: int = 1):
    return make_mesh(MeshConfig(data=data, expert=expert, tensor=tensor))


@functools.cache
def _forward(cfg: MoEConfig, par: ParallelConfig = DENSE, mesh_shape: tuple | None = None):
    mesh = None if mesh_shape is None else _mesh(*mesh_shape)
    return jax.jit(lambda p, x: moe_layer(p, x, cfg, par, mesh=mesh))


@functools.cache
def _value_and_grad(cfg: MoEConfig, par: ParallelConfig = DENSE, mesh_shape: tuple | None = None):
    mesh = None if mesh_shape is None else _mesh(*mesh_shape)

    def loss(p, x, proj):
        y, aux = moe_layer(p, x, cfg, par, mesh=mesh)
        return jnp.sum(y * proj) + aux.aux_loss + 0.1 * aux.z_loss, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# ----------------------------------------------------------------------------- dense vs loop reference

LOOP_CASES = {
    "swiglu-softmax": MoEConfig(num_experts=8, top_k=2, expert_hidden=F),
    "gelu-softmax-qwen-shared": MoEConfig(
        num_experts=8, top_k=3, expert_hidden=F, activation="gelu", norm_topk_prob=False, num_shared_experts=1
    ),
    "swiglu-sigmoid-groups-gated-shared": MoEConfig(
        num_experts=8,
        top_k=3,
        expert_hidden=F,
        score_func="sigmoid",
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        num_shared_experts=2,
        shared_expert_gate=True,
    ),
    "gelu-sigmoid-groups-gated-shared": MoEConfig(
        num_experts=16,
        top_k=4,
        expert_hidden=F,
        activation="gelu",
        score_func="sigmoid",
        num_groups=4,
        topk_groups=3,
        norm_topk_prob=False,
        num_shared_experts=1,
        shared_expert_hidden=24,
        shared_expert_gate=True,
    ),
}


@pytest.mark.parametrize("name", list(LOOP_CASES))
def test_dense_matches_loop_reference(name: str) -> None:
    cfg = LOOP_CASES[name]
    params, x = _params(cfg), _x()
    y, aux = _forward(cfg)(params, x)
    want, idx = moe_ref(jax.device_get(params), np.asarray(x), cfg)
    assert rel_err(y, want) < TOL
    np.testing.assert_array_equal(
        aux.tokens_per_expert, np.bincount(idx.reshape(-1), minlength=cfg.num_experts)
    )
    assert int(aux.num_dropped) == 0 and float(aux.drop_rate) == 0.0


def test_dense_with_capacity_matches_loop_reference_with_drops() -> None:
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, capacity_factor=0.5)
    params, x = _params(cfg, skew=True), _skewed_x()
    y, aux = _forward(cfg)(params, x)
    idx, wts, _, _ = route_ref(np.asarray(x), np.asarray(params["router"]["kernel"]), None, cfg)
    keep = keep_ref(idx, wts, cfg.num_experts, cfg.capacity(T), "probs")
    want, _ = moe_ref(jax.device_get(params), np.asarray(x), cfg, keep_TK=keep)
    assert rel_err(y, want) < TOL
    assert int(aux.num_dropped) == int((~keep).sum()) > 0


# ----------------------------------------------------------------------------- padded vs dense

BASE = MoEConfig(num_experts=8, top_k=2, expert_hidden=F)
PADDED_CASES = [
    (BASE, None, "probs"),
    (BASE, 0.5, "probs"),
    (BASE, 0.5, "position"),
    (BASE, 1.0, "probs"),
    (BASE, 1.0, "position"),
    (LOOP_CASES["swiglu-sigmoid-groups-gated-shared"], None, "probs"),
    (LOOP_CASES["gelu-sigmoid-groups-gated-shared"], 1.0, "position"),
]


def _rel_tree(a, b) -> float:
    errs = jax.tree.leaves(jax.tree.map(rel_err, a, b))
    return max(errs)


@pytest.mark.parametrize(
    "cfg, cf, policy", PADDED_CASES, ids=[f"{c.score_func}-cf{cf}-{p}" for c, cf, p in PADDED_CASES]
)
def test_padded_equals_dense_values_and_grads(cfg: MoEConfig, cf, policy: str) -> None:
    cfg = dataclasses.replace(cfg, capacity_factor=cf, drop_policy=policy)
    params, x = _params(cfg, skew=True), _skewed_x()
    proj = jax.random.normal(jax.random.key(7), (T, D))
    (loss_d, (y_d, aux_d)), grads_d = _value_and_grad(cfg, DENSE)(params, x, proj)
    (loss_p, (y_p, aux_p)), grads_p = _value_and_grad(cfg, PADDED)(params, x, proj)

    counts = np.asarray(aux_d.tokens_per_expert)
    assert counts.max() >= 2 * T * cfg.top_k / cfg.num_experts and counts.min() == 0, counts  # skewed
    assert rel_err(y_p, y_d) < TOL
    # the loss is a sum with cancellation: compare against the size of its terms
    assert abs(float(loss_p) - float(loss_d)) < TOL * float(jnp.sum(jnp.abs(y_d * proj)))
    assert rel_err(grads_p[1], grads_d[1]) < TOL  # x
    assert rel_err(grads_p[0]["router"]["kernel"], grads_d[0]["router"]["kernel"]) < TOL
    assert _rel_tree(grads_p[0]["experts"], grads_d[0]["experts"]) < TOL
    for key in ("tokens_per_expert", "num_dropped", "drop_rate"):
        np.testing.assert_array_equal(getattr(aux_p, key), getattr(aux_d, key))

    expected_dropped = 0 if cf is None else int(np.maximum(counts - cfg.capacity(T), 0).sum())
    assert int(aux_p.num_dropped) == expected_dropped
    assert (expected_dropped > 0) == (cf is not None)
    # experts that received no token get exactly zero gradient
    empty = counts == 0
    for w in grads_p[0]["experts"].values():
        assert float(jnp.abs(w[empty]).max()) == 0.0


def test_aux_contents() -> None:
    cfg = dataclasses.replace(BASE, capacity_factor=0.5)
    params, x = _params(cfg, skew=True), _skewed_x()
    _, aux = _forward(cfg, PADDED)(params, x)
    assert int(aux.tokens_per_expert.sum()) == T * cfg.top_k
    np.testing.assert_allclose(float(aux.drop_rate), int(aux.num_dropped) / (T * cfg.top_k), rtol=1e-7)
    assert 0 < float(aux.drop_rate) < 1
    assert aux.aux_loss.shape == () and aux.z_loss.shape == ()


# ----------------------------------------------------------------------------- meshes

MESH_CASES = [
    # (num_experts, (data, expert, tensor), dispatch, capacity_factor): experts per device E/expert
    (8, (2, 4, 1), "dense", None),  # 2
    (8, (2, 4, 1), "padded", 1.0),  # 2, dropping
    (8, (1, 8, 1), "padded", None),  # 1
    (8, (4, 2, 1), "dense", 1.0),  # 4, dropping
    (8, (4, 2, 1), "padded", None),  # 4
    (8, (8, 1, 1), "padded", 0.5),  # 8, pure data parallel, dropping
    (8, (2, 2, 2), "dense", None),  # 4, tensor axis
    (8, (2, 2, 2), "padded", 1.0),  # 4, tensor axis, dropping
    (16, (2, 4, 1), "padded", None),  # 4
    (16, (2, 4, 1), "dense", 1.0),  # 4, dropping
]


def _mesh_cfg(num_experts: int, cf) -> MoEConfig:
    return MoEConfig(
        num_experts=num_experts,
        top_k=2,
        expert_hidden=F,
        num_shared_experts=1,
        shared_expert_gate=True,
        capacity_factor=cf,
    )


@pytest.mark.parametrize(
    "num_experts, mesh_shape, dispatch, cf",
    MESH_CASES,
    ids=[f"E{e}-{m}-{d}-cf{c}" for e, m, d, c in MESH_CASES],
)
def test_mesh_equals_no_mesh(num_experts: int, mesh_shape: tuple, dispatch: str, cf) -> None:
    cfg, par = _mesh_cfg(num_experts, cf), ParallelConfig(dispatch=dispatch)
    params, x = _params(cfg, skew=True), _skewed_x()
    y_ref, aux_ref = _forward(cfg, par)(params, x)
    y, aux = _forward(cfg, par, mesh_shape)(params, x)
    assert rel_err(y, y_ref) < TOL
    for key in ("tokens_per_expert", "num_dropped"):
        np.testing.assert_array_equal(getattr(aux, key), getattr(aux_ref, key))
    np.testing.assert_allclose(float(aux.aux_loss), float(aux_ref.aux_loss), rtol=TOL)
    if cf is not None and cf < 1.0:
        assert int(aux.num_dropped) > 0
    # the output is laid out over the token axes of the mesh
    assert y.sharding.spec[0] is not None


@pytest.mark.parametrize("mesh_shape", [(2, 4, 1), (2, 2, 2)])
def test_mesh_gradients_equal_no_mesh(mesh_shape: tuple) -> None:
    cfg = _mesh_cfg(8, 1.0)
    params, x = _params(cfg, skew=True), _skewed_x()
    proj = jax.random.normal(jax.random.key(7), (T, D))
    (_, (y_ref, _)), g_ref = _value_and_grad(cfg, PADDED)(params, x, proj)
    (_, (y, _)), g = _value_and_grad(cfg, PADDED, mesh_shape)(params, x, proj)
    assert rel_err(y, y_ref) < TOL
    assert _rel_tree(g, g_ref) < TOL
