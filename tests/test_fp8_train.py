"""FP8 in training (model.fp8): a tiny run with FP8 on tracks the same run without it, and a
checkpoint written without FP8 resumes with it (the parameters and optimizer state are the same
trees: FP8 changes how GEMMs run, not what is stored). CPU, 8 fake devices; the XLA oracle runs
the FP8 GEMMs here (fp8/gmm.py), so this checks the wiring and numerics, not speed."""

from __future__ import annotations

import math
import pathlib

import pytest

from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.train.loop import train

TINY = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
# pft dispatch: the routed experts run the grouped GEMM (gmm_fp8 with FP8 on)
BASE = ["parallel.dispatch=pft", "train.log_every=1", "checkpoint.every=2", "checkpoint.async_save=false"]
FP8 = "model.fp8={recipe: blockwise, grad_format: e4m3}"


def _cfg(run_dir, *overrides):
    return load_config(TINY, [f"train.run_dir={run_dir}", *BASE, *overrides])


@pytest.mark.slow  # ~65 s (3 trainings); FP8 numerics in the default run: test_fp8.py, the dispatch oracle below
def test_fp8_run_tracks_bf16_and_resumes_with_fp8_switched_on(tmp_path):
    off = train(_cfg(tmp_path / "off", "train.steps=2"))
    on = train(_cfg(tmp_path / "on", "train.steps=4", FP8))
    assert on.losses[1] != off.losses[1]  # the FP8 GEMMs did run
    for step in (1, 2):  # same seed, same data: FP8 moves the loss by a fraction of a percent
        assert math.isfinite(on.losses[step])
        assert abs(on.losses[step] - off.losses[step]) / off.losses[step] < 0.01, (
            step,
            on.losses,
            off.losses,
        )
    # the bf16 checkpoint at step 2 resumes with FP8 on
    resumed = train(_cfg(tmp_path / "off", "train.steps=4", FP8), resume=True)
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert math.isfinite(resumed.losses[step])
        assert abs(resumed.losses[step] - on.losses[step]) / on.losses[step] < 0.01


def test_fp8_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"model\.fp8\.recipe='delayed' is not one of"):
        load_config(TINY, ["model.fp8={recipe: delayed}"])
    with pytest.raises(ConfigError, match=r"model\.fp8=null"):
        load_config(TINY, ["model.fp8={projections: false, experts: false}"])
    with pytest.raises(ConfigError, match=r"unknown config key model\.fp8\.amax_history"):
        load_config(TINY, ["model.fp8={amax_history: 16}"])
    assert load_config(TINY, ["model.fp8=null"]).model.fp8 is None


def test_policy_covers_what_the_config_says():
    cfg = load_config(TINY, ["model.fp8={recipe: rowwise, experts: false}"]).model.fp8
    assert fp8_context.recipe_for("experts") is None
    with fp8_context.use(cfg):
        assert fp8_context.recipe_for("experts") is None
        assert fp8_context.recipe_for("projections").name == "rowwise"
    assert fp8_context.recipe_for("projections") is None


# ---------------------------------------------------------------- FP8 dispatch (pft, fake CPU mesh)


def test_fp8_dispatch_equals_oracle_on_quantized_rows():
    """pft with model.fp8.dispatch on a (data 2, expert 4) mesh == the dense oracle routing the
    exact x and running the experts on x quantized in 1x128 row tiles (the exchange moves whole
    rows, so quantizing the send buffer is quantizing x's rows); the gradient w.r.t. x passes the
    quantization straight through, and the dispatch half of wire_bytes is e4m3 + scales."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from xmoe_jax.config import FP8Config, MeshConfig, MoEConfig, ParallelConfig
    from xmoe_jax.fp8 import fake_quantize
    from xmoe_jax.moe import init_moe_params, moe_layer, router
    from xmoe_jax.moe.dense import dense_dispatch
    from xmoe_jax.sharding import make_mesh

    t, d = 64, 256  # two 128-column tiles per row
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16)  # no shared expert: experts see only x_q
    params = init_moe_params(jax.random.key(1), d, cfg, std=0.1)
    x = jax.random.normal(jax.random.key(0), (t, d), jnp.float32)
    mesh = make_mesh(MeshConfig(data=2, expert=4, tensor=1))
    policy = FP8Config(projections=False, experts=False, dispatch=True)

    def pft(p, x):
        with fp8_context.use(policy):
            y, aux = moe_layer(p, x, cfg, ParallelConfig(dispatch="pft", transport="emulated"), mesh=mesh)
        return y, aux

    def oracle(p, x):
        r = router.route(x, p["router"]["kernel"], None, cfg)
        x_q = x + jax.lax.stop_gradient(fake_quantize(x, (1, 128), jnp.float8_e4m3fn) - x)  # straight through
        return dense_dispatch(
            x_q, r.topk_idx_TK, r.topk_weight_TK, p["experts"], cfg.activation, lambda a, _: a
        )

    y, aux = jax.jit(pft)(params, x)
    y_ref = jax.jit(oracle)(params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    g_x = jax.jit(jax.grad(lambda x: pft(params, x)[0].sum()))(x)
    g_ref = jax.jit(jax.grad(lambda x: oracle(params, x).sum()))(x)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_ref), rtol=1e-4, atol=1e-5 * np.abs(g_ref).max())
    # dispatch sends d + 4 * 2 bytes per row, the combine 4 * d (float32 here): ratio 264 / 1024
    _, aux_off = jax.jit(lambda p, x: moe_layer(p, x, cfg, ParallelConfig(dispatch="pft", transport="emulated"),
                                                  mesh=mesh))(params, x)  # fmt: skip
    ratio = np.asarray(aux.wire_bytes).sum() / np.asarray(aux_off.wire_bytes).sum()
    assert ratio == pytest.approx((d + 8 + 4 * d) / (2 * 4 * d))
