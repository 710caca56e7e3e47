"""RBD: exact against the dense oracle / PFT, exactly one pilot per (token, node), and with
node-limited routing at most M = topk_groups pilots per token.

8 fake CPU devices; the expert group is expert_nodes x devices per node (node-major).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import route_ref

from xmoe_jax.config import Config, ConfigError, MeshConfig, ModelConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer
from xmoe_jax.moe.rbd import stage2_spec
from xmoe_jax.perf.rbd_cost import (
    expected_distinct_nodes,
    node_limited_distinct_nodes,
    predict,
    uniform_saving,
)
from xmoe_jax.sharding import make_mesh

DIM, TOKENS = 16, 64


def _inputs(cfg: MoEConfig, skew: bool = True):
    params = init_moe_params(jax.random.key(0), DIM, cfg, std=0.3)
    if skew:  # some experts crowded, some empty, some devices receive nothing
        params["router"]["kernel"] = params["router"]["kernel"].at[:, 0].add(0.8).at[:, 3].add(-2.0)
    x = jax.random.normal(jax.random.key(1), (TOKENS, DIM)) + 0.5
    return params, x


RBD, PFT, DENSE = (ParallelConfig(dispatch=d) for d in ("rbd", "pft", "dense"))


@functools.cache
def _fn(cfg: MoEConfig, par: ParallelConfig, mesh_cfg: MeshConfig | None):
    mesh = make_mesh(mesh_cfg) if mesh_cfg is not None else None
    proj = jnp.sin(jnp.arange(DIM, dtype=jnp.float32))

    def objective(params, x):
        y, aux = moe_layer(params, x, cfg, par, mesh=mesh)
        return jnp.sum(y * proj) + aux.aux_loss, (y, aux)

    return jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))


def _assert_same(got, want):
    (_, (y, _)), grads = got
    (_, (y_ref, _)), grads_ref = want
    assert _rel(y, y_ref) < 1e-5
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        assert _rel(g, g_ref) < 1e-5


LAYOUTS = [  # (num_experts, top_k, data, expert, expert_nodes): nodes of 2 and 4; 1, 2, 4 experts/device
    (8, 2, 2, 4, 2),
    (8, 2, 1, 8, 2),
    (16, 4, 1, 8, 4),
    (16, 6, 2, 4, 2),
    (16, 4, 2, 4, 4),  # single-device nodes, 4 experts per device
]


def _dropless_equals_dense(cfg: MoEConfig, par: ParallelConfig, mesh_cfg: MeshConfig):
    """(params, x, statistics) of a dropless run that equals the dense oracle, with no overflow."""
    params, x = _inputs(cfg)
    got = _fn(cfg, par, mesh_cfg)(params, x)
    _assert_same(got, _fn(cfg, DENSE, None)(params, x))
    aux = got[0][1][1]
    assert int(aux.num_overflow) == 0
    return params, x, aux


@pytest.mark.parametrize("num_experts, top_k, data, expert, nodes", LAYOUTS)
def test_rbd_dropless_equals_dense(num_experts, top_k, data, expert, nodes):
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=16)
    mesh_cfg = MeshConfig(data=data, expert=expert, expert_nodes=nodes)
    params, x, aux = _dropless_equals_dense(cfg, RBD, mesh_cfg)
    # exactly one pilot row per distinct (token, destination node), per source device
    idx = np.asarray(jax.lax.top_k(jax.nn.softmax(x @ params["router"]["kernel"]), top_k)[1])
    node = idx // (num_experts // nodes)
    shards = node.reshape(data * expert, -1, top_k)
    want = [sum(len(set(row)) for row in shard) for shard in shards]
    assert np.asarray(aux.pilot_rows).tolist() == want
    own = np.repeat(np.arange(nodes), expert // nodes)[None, :].repeat(data, 0).reshape(-1)
    inter = [sum(len(set(row) - {own[d]}) for row in shards[d]) for d in range(len(shards))]
    assert np.asarray(aux.inter_node_rows).tolist() == inter


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_rbd_dropping_equals_pft(policy):
    """Same per-source-shard keep mask as pft, so the two must agree exactly."""
    cfg = MoEConfig(
        num_experts=8,
        top_k=2,
        expert_hidden=16,
        capacity_factor=0.75,
        drop_policy=policy,
        score_func="sigmoid",
    )
    params, x = _inputs(cfg)
    got = _fn(cfg, RBD, MeshConfig(data=2, expert=4, expert_nodes=2))(params, x)
    want = _fn(cfg, PFT, MeshConfig(data=2, expert=4))(params, x)
    _assert_same(got, want)
    assert int(got[0][1][1].num_dropped) > 0
    assert int(got[0][1][1].num_dropped) == int(want[0][1][1].num_dropped)


def test_stage2_receive_buffer_keeps_the_pft_meaning():
    """f sizes stage 2's buffer at f x (T*K), the average copies per device, not f x M1 x K2."""
    tokens, nodes, local = 1000, 2, 2
    spec = stage2_spec(16, 6, "swiglu", tokens, nodes, local, recv_buffer_factor=1.25)
    assert (spec.num_experts, spec.slots) == (8, 6)
    assert abs(spec.recv_rows - math.ceil(1.25 * tokens * 6)) <= 1
    worst = stage2_spec(16, 6, "swiglu", tokens, nodes, local, recv_buffer_factor=None)
    assert worst.recv_rows == local * nodes * tokens * min(6, 8 // local)


@pytest.mark.parametrize("factor, overflows", [(3.0, False), (0.25, True)])
def test_rbd_receive_buffer_factor(factor, overflows):
    """A big enough buffer is exact; a small one overflows and says so (never silently)."""
    cfg = MoEConfig(num_experts=16, top_k=4, expert_hidden=16)
    par = ParallelConfig(dispatch="rbd", recv_buffer_factor=factor)
    params, x = _inputs(cfg, skew=False)
    got = _fn(cfg, par, MeshConfig(data=1, expert=8, expert_nodes=2))(params, x)
    overflow = int(got[0][1][1].num_overflow)
    assert (overflow > 0) == overflows
    if not overflows:
        _assert_same(got, _fn(cfg, DENSE, None)(params, x))


def test_rbd_without_mesh_and_single_node_match_dense():
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=1)
    params, x = _inputs(cfg, skew=False)
    want = _fn(cfg, DENSE, None)(params, x)
    _assert_same(_fn(cfg, RBD, None)(params, x), want)
    _assert_same(_fn(cfg, RBD, MeshConfig(data=2, expert=4, expert_nodes=1))(params, x), want)


def test_expert_nodes_must_divide_expert():
    with pytest.raises(ConfigError, match="expert_nodes"):
        MeshConfig(expert=4, expert_nodes=3)


def test_cost_model_matches_design_figures():
    # docs/design.md#rbd: E=256, k=8, 8 GPUs per node: 75% at EP16, 55% at EP32, 34% at EP64
    assert round(uniform_saving(256, 8, 2), 2) == 0.75
    assert round(uniform_saving(256, 8, 4), 2) == 0.55
    assert round(uniform_saving(256, 8, 8), 2) == 0.34
    # measured routing: counts are exact
    idx = np.array([[0, 1], [0, 5], [4, 6], [2, 7]])  # 8 experts on 2 nodes of 4
    out = predict(8, 2, 2, tokens=4, topk_idx_TK=idx)
    assert out["pft_rows"] == 8 and out["rbd_rows"] == 6
    # Monte Carlo agrees with the closed form
    rng = np.random.default_rng(0)
    draws = np.stack([rng.choice(64, 6, replace=False) for _ in range(4000)])
    mc = predict(64, 6, 4, tokens=4000, topk_idx_TK=draws)["rbd_rows"] / 4000
    assert abs(mc - expected_distinct_nodes(64, 6, 4)) < 0.05


# ----------------------------------------------------------------------------- node-limited routing

NODE_LIMITED = [  # (num_experts, top_k, data, expert, nodes, M = topk_groups): 2 and 4 nodes
    (16, 4, 1, 8, 2, 1),  # 2 nodes of 4 devices: every token's copies on one node
    (16, 6, 2, 4, 4, 2),  # 4 single-device nodes, 4 experts per device
    (32, 6, 1, 8, 4, 2),  # 4 nodes of 2 devices
]


def _node_limited(num_experts, top_k, nodes, limit):
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=16, score_func="sigmoid")
    return dataclasses.replace(cfg, num_groups=nodes, topk_groups=limit)


@pytest.mark.parametrize("num_experts, top_k, data, expert, nodes, limit", NODE_LIMITED)
def test_node_limited_rbd_equals_dense_and_sends_at_most_m_rows_per_token(
    num_experts, top_k, data, expert, nodes, limit
):
    cfg = _node_limited(num_experts, top_k, nodes, limit)
    par = ParallelConfig(dispatch="rbd", route_groups_by_node=True)
    mesh_cfg = MeshConfig(data=data, expert=expert, expert_nodes=nodes)
    params, x, aux = _dropless_equals_dense(cfg, par, mesh_cfg)
    # per token, the distinct destination nodes of its routing (independent reference) are <= M,
    # and the pilots each device sent are exactly those
    idx, *_ = route_ref(np.asarray(x), np.asarray(params["router"]["kernel"]), None, cfg)
    nodes_T = np.asarray([len(set(row)) for row in idx // (num_experts // nodes)])
    assert nodes_T.max() <= limit
    local = TOKENS // (data * expert)
    assert np.asarray(aux.pilot_rows).tolist() == nodes_T.reshape(-1, local).sum(1).tolist()
    assert (np.asarray(aux.pilot_rows) <= limit * local).all()
    assert int(np.max(aux.max_nodes_per_token)) == nodes_T.max()
    # the bound is not vacuous: without the node limit some token reaches more than M nodes
    free = _node_limited(num_experts, top_k, nodes, nodes)
    free_idx, *_ = route_ref(np.asarray(x), np.asarray(params["router"]["kernel"]), None, free)
    assert max(len(set(row)) for row in free_idx // (num_experts // nodes)) > limit


def test_route_groups_by_node_is_checked_against_the_mesh():
    cfg = _node_limited(16, 4, 4, 2)
    par = ParallelConfig(dispatch="rbd", route_groups_by_node=True)
    with pytest.raises(
        ConfigError, match=r"num_groups=4 must equal the expert nodes \(mesh.expert_nodes=2\)"
    ):
        Config(model=ModelConfig(moe=cfg), mesh=MeshConfig(expert=8, expert_nodes=2), parallel=par)
    params, x = _inputs(cfg)
    with pytest.raises(ConfigError, match="mesh.expert_nodes=2"):  # a library call on the wrong mesh
        moe_layer(params, x, cfg, par, mesh=make_mesh(MeshConfig(data=1, expert=8, expert_nodes=2)))


def test_node_limited_cost_model():
    # DeepSeek-V3: E=256, k=8, 8 groups on 8 nodes, M=4: at most 4 rows per token, ~3.63 uniform
    assert predict(256, 8, 8, tokens=1, max_nodes=4)["max_rows_per_token"] == 4
    assert node_limited_distinct_nodes(256, 8, 8, 4) == pytest.approx(3.629, abs=1e-3)
    assert node_limited_distinct_nodes(256, 8, 8, 4) < expected_distinct_nodes(256, 8, 8)
    rng = np.random.default_rng(0)  # Monte Carlo: 4 random nodes, then 8 experts among theirs
    draws = []
    for _ in range(4000):
        chosen = rng.choice(8, 4, replace=False)
        pool = (chosen[:, None] * 32 + np.arange(32)).reshape(-1)
        draws.append(rng.choice(pool, 8, replace=False))
    measured = predict(256, 8, 8, tokens=4000, topk_idx_TK=np.stack(draws))
    assert abs(measured["rbd_rows"] / 4000 - node_limited_distinct_nodes(256, 8, 8, 4)) < 0.05
    assert measured["max_rows_per_token"] <= 4
