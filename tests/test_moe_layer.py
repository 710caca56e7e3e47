"""`moe_layer`: the dense oracle vs a NumPy loop (with and without drops), padded's statistics.

padded (and every other dispatch mode) vs the dense oracle, values and gradients, with and without
a mesh: tests/test_dispatch_oracle.py.
T=64 tokens, D=16, F=32, float32. Compiled functions are cached per config so that each variant
compiles once per session.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import keep_ref, moe_ref, rel_err, route_ref

from xmoe_jax.config import MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer

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
def _forward(cfg: MoEConfig, par: ParallelConfig = DENSE):
    return jax.jit(lambda p, x: moe_layer(p, x, cfg, par))


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


# ----------------------------------------------------------------------------- padded


BASE = MoEConfig(num_experts=8, top_k=2, expert_hidden=F)


def test_aux_contents() -> None:
    cfg = dataclasses.replace(BASE, capacity_factor=0.5)
    params, x = _params(cfg, skew=True), _skewed_x()
    _, aux = _forward(cfg, PADDED)(params, x)
    assert int(aux.tokens_per_expert.sum()) == T * cfg.top_k
    np.testing.assert_allclose(float(aux.drop_rate), int(aux.num_dropped) / (T * cfg.top_k), rtol=1e-7)
    assert 0 < float(aux.drop_rate) < 1
    assert aux.aux_loss.shape == () and aux.z_loss.shape == ()
