"""Stage generators (moe/stages.py) and the per-stage benchmark's prefixes (perf/stages.py).

8 fake CPU devices, 2 nodes x 4 devices; tiny shapes. The prefixes must compute what
the layer computes (the layer prefix equals moe_layer), name the stages the
dispatch really has, and count node-axis rows as RBD's own statistics do.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer
from xmoe_jax.moe.stages import prefixed, run, run_until
from xmoe_jax.perf import stages as bench_stages
from xmoe_jax.sharding import make_mesh

DIM, TOKENS = 16, 128


def _toy():
    yield "a", (1,)
    yield "b", (2,)
    return "done"


def test_run_run_until_prefixed():
    seen = []
    assert run(_toy(), seen.append) == "done" and seen == ["a", "b"]
    assert run_until(_toy(), "b") == (2,)
    with pytest.raises(KeyError, match="stages are"):
        run_until(_toy(), "c")

    def outer():
        result = yield from prefixed("in", _toy())
        yield "after", (result,)
        return result

    names = []
    assert run(outer(), names.append) == "done" and names == ["in/a", "in/b", "after"]


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(MeshConfig(data=1, expert=8, expert_nodes=2))
    cfg = MoEConfig(num_experts=16, top_k=4, expert_hidden=16)
    params = init_moe_params(jax.random.key(0), DIM, cfg, std=0.3)
    params["router"]["kernel"] = params["router"]["kernel"].at[:, 0].add(0.8)  # skewed
    x = jax.random.normal(jax.random.key(1), (TOKENS, DIM)) + 0.5
    return mesh, cfg, params, x


RBD = ParallelConfig(dispatch="rbd")


def test_stage_names(setup):
    mesh, cfg, params, x = setup
    assert bench_stages.stage_names(cfg, RBD, mesh, params, x) == [
        "pilots",
        "stage1",
        "stage2/send_buffer",
        "stage2/exchange",
        "stage2/experts",
        "stage2/return",
        "stage2/combine",
        "return",
    ]
    pft = ParallelConfig(dispatch="pft")
    assert bench_stages.stage_names(cfg, pft, mesh, params, x) == [
        "send_buffer",
        "exchange",
        "experts",
        "return",
    ]


def test_layer_prefix_is_the_layer_and_rows_match_rbd(setup):
    mesh, cfg, params, x = setup
    (y_pre,) = bench_stages.compiled_prefix(cfg, RBD, mesh, bench_stages.LAYER)(params, x)
    y, aux = jax.jit(lambda p, x: moe_layer(p, x, cfg, RBD, mesh=mesh))(params, x)
    np.testing.assert_allclose(np.asarray(y_pre), np.asarray(y), rtol=1e-6, atol=1e-6)

    rows = bench_stages.node_rows(cfg, RBD, mesh, params, x)
    assert rows["rbd_node_rows"] == int(np.asarray(aux.inter_node_rows).sum())
    # pft: every kept copy whose expert is on the other node (node = expert // 8 here)
    idx = np.asarray(jax.lax.top_k(x @ params["router"]["kernel"], 4)[1])
    src_node = np.arange(TOKENS) // (TOKENS // 2)
    assert rows["pft_node_rows"] == int((idx // 8 != src_node[:, None]).sum())
    assert 0 < rows["rbd_node_rows"] < rows["pft_node_rows"]
    assert rows["pft_node_bytes"] == 2 * rows["pft_node_rows"] * DIM * 4


def test_stage_prefix_arrays(setup):
    """The stage-1 prefix returns the pilots as received: one row per (token, node) pair."""
    mesh, cfg, params, x = setup
    x_pil, w_pil, idx_pil = bench_stages.compiled_prefix(cfg, RBD, mesh, "stage1")(params, x)
    per_device = TOKENS // 8 * 2  # M1 = N * T rows per device
    assert x_pil.shape == (8 * per_device, DIM) and idx_pil.shape[0] == 8 * per_device
    valid = (np.asarray(w_pil) > 0).any(-1)  # a received pilot carries its experts' weights
    total = int(valid.sum())
    route_idx, _, _ = bench_stages.compiled_prefix(cfg, RBD, mesh, bench_stages.ROUTE)(params, x)
    node = np.asarray(route_idx) // 8
    assert total == sum(len(set(r)) for r in node)  # every (token, node) pair arrived once
    assert np.all(np.asarray(idx_pil)[valid] <= 8)  # node-local expert ids (8 = empty slot)


def test_backward_layer_prefix_is_the_layer_gradient(setup):
    """The fwd+bwd prefix of the whole layer differentiates exactly what moe_layer computes."""
    mesh, cfg, params, x = setup
    got = bench_stages.compiled_prefix(cfg, RBD, mesh, bench_stages.LAYER, True)(params, x)

    def loss(p, x):
        y, _ = moe_layer(p, x, cfg, RBD, mesh=mesh)
        return jax.numpy.sum(jax.numpy.square(y))

    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
