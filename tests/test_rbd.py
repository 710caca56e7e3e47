"""RBD: stage 2's buffer sizing, a small receive buffer overflows and says so, node-limited routing
reaches at most M = topk_groups nodes per token, and the cost model.

rbd against the dense oracle on every layout (nodes of 2 and 4, TP, dropping, node-limited), with
one pilot per (token, node): tests/test_dispatch_oracle.py, with every other dispatch mode.
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
from xmoe_jax.moe.pft import ROW_ALIGN
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


@functools.cache
def _fn(cfg: MoEConfig, par: ParallelConfig, mesh_cfg: MeshConfig | None):
    mesh = make_mesh(mesh_cfg) if mesh_cfg is not None else None
    proj = jnp.sin(jnp.arange(DIM, dtype=jnp.float32))

    def objective(params, x):
        y, aux = moe_layer(params, x, cfg, par, mesh=mesh)
        return jnp.sum(y * proj) + aux.aux_loss, (y, aux)

    return jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))


def test_stage2_receive_buffer_keeps_the_pft_meaning():
    """f sizes stage 2's buffer at f x (T*K), the average copies per device, not f x M1 x K2 (rounded up
    to a multiple of 8 rows, as every compact receive buffer)."""
    tokens, nodes, local = 1000, 2, 2
    spec = stage2_spec(16, 6, "swiglu", tokens, nodes, local, recv_buffer_factor=1.25)
    assert (spec.num_experts, spec.slots) == (8, 6)
    assert spec.recv_rows == -(-math.ceil(1.25 * tokens * 6) // ROW_ALIGN) * ROW_ALIGN  # 7,500 -> 7,504
    worst = stage2_spec(16, 6, "swiglu", tokens, nodes, local, recv_buffer_factor=None)
    assert worst.recv_rows == local * nodes * tokens * min(6, 8 // local)


def test_rbd_small_receive_buffer_overflows_and_says_so():
    """A small buffer overflows and says so, never silently (a big enough one is exact:
    test_dispatch_oracle.py's rbd-ep8-nodes2-K4-buffer3)."""
    cfg = MoEConfig(num_experts=16, top_k=4, expert_hidden=16)
    par = ParallelConfig(dispatch="rbd", recv_buffer_factor=0.25)
    params, x = _inputs(cfg, skew=False)
    got = _fn(cfg, par, MeshConfig(data=1, expert=8, expert_nodes=2))(params, x)
    assert int(got[0][1][1].num_overflow) > 0


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

NODE_LIMITED = [  # (num_experts, top_k, nodes, M = topk_groups): 2 and 4 nodes
    (16, 4, 2, 1),  # every token's copies on one node
    (16, 6, 4, 2),
    (32, 6, 4, 2),
]


def _node_limited(num_experts, top_k, nodes, limit):
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=16, score_func="sigmoid")
    return dataclasses.replace(cfg, num_groups=nodes, topk_groups=limit)


@pytest.mark.parametrize("num_experts, top_k, nodes, limit", NODE_LIMITED)
def test_node_limited_routing_reaches_at_most_m_nodes(num_experts, top_k, nodes, limit):
    """Per token, the distinct destination nodes of its routing (independent reference) are <= M, and
    the bound is not vacuous. (rbd on these layouts sends exactly those pilots and equals the dense
    oracle: test_dispatch_oracle.py's rbd-*-limit* cases.)"""
    cfg = _node_limited(num_experts, top_k, nodes, limit)
    params, x = _inputs(cfg)
    idx, *_ = route_ref(np.asarray(x), np.asarray(params["router"]["kernel"]), None, cfg)
    nodes_T = np.asarray([len(set(row)) for row in idx // (num_experts // nodes)])
    assert nodes_T.max() <= limit
    # without the node limit some token reaches more than M nodes
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
