"""Multi-head latent attention (model/mla.py) against a float64 NumPy reference written from the
DeepSeek-V2 paper (tests/reference.py: forward, and gradients by central differences), with and
without the query latent, YaRN and interleaved RoPE; the model under tensor parallelism 1/2/4;
the Pallas backend (interpret mode); on a GPU, cuDNN and Pallas against XLA in bf16."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import mla_ref, rel_err

from xmoe_jax.config import MeshConfig, MLAConfig, ModelConfig, ParallelConfig, RopeScalingConfig, load_config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.model.attention import choose
from xmoe_jax.model.mla import MLAttention
from xmoe_jax.sharding import make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
DIMS = dict(C=12, N=6, R=8, U=5)
YARN = RopeScalingConfig(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5)
B, S = 2, 10


def _cfg(q_lora=None, yarn=False, interleave=True, **over) -> ModelConfig:
    mla = MLAConfig(
        kv_lora_rank=DIMS["C"], q_lora_rank=q_lora, qk_nope_head_dim=DIMS["N"], qk_rope_head_dim=DIMS["R"],
        v_head_dim=DIMS["U"], rope_interleave=interleave,
    )  # fmt: skip
    return ModelConfig(
        hidden=16, num_heads=4, num_layers=1, num_dense_layers=1, moe=None, dtype="float32", init_std=0.3,
        rope_theta=100.0, attention_type="mla", mla=mla, rope_scaling=YARN if yarn else None, **over,
    )  # fmt: skip


def _layer(cfg: ModelConfig) -> MLAttention:
    attn = MLAttention(cfg, nnx.Rngs(params=0))
    keys = iter(jax.random.split(jax.random.key(7), 4))
    for _, var in nnx.iter_graph(attn):  # norm scales start at one: make them count
        if isinstance(var, nnx.Param) and var[...].ndim == 1:
            var[...] = 1 + 0.3 * jax.random.normal(next(keys), var[...].shape)
    return attn


def _weights(attn: MLAttention) -> dict:
    names = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
    w = {n: np.asarray(getattr(attn, n)[...]) for n in names if hasattr(attn, n)}
    w["kv_norm"] = np.asarray(attn.kv_norm.scale[...])
    if hasattr(attn, "q_norm"):
        w["q_norm"] = np.asarray(attn.q_norm.scale[...])
    return w


def _ref(cfg: ModelConfig, w: dict, x_SD) -> np.ndarray:
    yarn = dataclasses.asdict(cfg.rope_scaling) if cfg.rope_scaling else None
    return mla_ref(x_SD, w, cfg.num_heads, DIMS, cfg.rope_theta, cfg.norm_eps, yarn, cfg.mla.rope_interleave)


def _x(seq: int = S, seed: int = 3) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (B, seq, 16), jnp.float32)


VARIANTS = [(None, False, True), (10, True, True), (10, False, False)]  # (q_lora_rank, yarn, interleave)


@pytest.mark.parametrize("q_lora, yarn, interleave", VARIANTS)
def test_mla_matches_numpy_reference(q_lora, yarn, interleave) -> None:
    cfg = _cfg(q_lora, yarn, interleave)
    attn = _layer(cfg)
    x = _x()
    y = attn(x)
    assert y.shape == (B, S, 16)
    for b in range(B):
        assert rel_err(y[b], _ref(cfg, _weights(attn), np.asarray(x[b]))) < 1e-5


@pytest.mark.parametrize("q_lora, yarn, interleave", VARIANTS[:2])
def test_mla_gradients_match_reference_central_differences(q_lora, yarn, interleave) -> None:
    """Per weight and for the input, the directional derivative along a random direction: ours
    (autodiff, float32) against the float64 reference's central difference."""
    cfg = _cfg(q_lora, yarn, interleave)
    attn = _layer(cfg)
    graphdef, state = nnx.split(attn)
    x = _x()[:1]
    proj = np.asarray(jax.random.normal(jax.random.key(9), (S, 16)), np.float64)

    def ours(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0] * proj.astype(np.float32))

    g_state, g_x = jax.grad(ours, argnums=(0, 1))(state, x)
    grads = {**_weights(nnx.merge(graphdef, g_state)), "x": np.asarray(g_x[0])}
    values = {**_weights(attn), "x": np.asarray(x[0], np.float64)}
    rng = np.random.default_rng(0)
    for name, value in values.items():
        d = rng.normal(size=value.shape)

        def ref_objective(sign, name=name, d=d):
            v = {**values, name: values[name] + sign * 1e-6 * d}
            return float(np.sum(_ref(cfg, {k: a for k, a in v.items() if k != "x"}, v["x"]) * proj))

        want = (ref_objective(1) - ref_objective(-1)) / 2e-6
        got = float(np.sum(grads[name].astype(np.float64) * d))
        assert abs(got - want) <= 1e-4 * abs(want) + 1e-6, name


def test_mla_pallas_backend_equals_xla() -> None:
    """The Pallas flash-attention kernel (interpret mode on CPU) on MLA's K = N + R query/key dims,
    values padded from U to K: forward and gradients equal XLA's."""
    x = _x(32)
    results = {}
    for impl in ("xla", "pallas"):
        attn = _layer(_cfg(10, True, attention=impl))
        graphdef, state = nnx.split(attn)
        loss = lambda s, x, g=graphdef: jnp.sum(nnx.merge(g, s)(x) ** 2)  # noqa: E731
        results[impl] = (attn(x), *jax.grad(loss, argnums=(0, 1))(state, x))
    for a, b in zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"]), strict=True):
        assert rel_err(a, b) < 1e-5


# ----------------------------------------------------------------------------- the model under TP


def _tiny_mla(**over) -> ModelConfig:
    base = load_config(CONFIGS / "tiny.yaml", ["model.dtype=float32"]).model
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    return dataclasses.replace(
        base, attention_type="mla", mla=mla, num_kv_heads=None, head_dim=None, rope_scaling=YARN, **over
    )


@functools.cache
def _loss_grad(model_cfg, par: ParallelConfig, mesh_cfg: MeshConfig | None):
    spec = fmodel.model_spec(model_cfg, par)
    params, bias = fmodel.init_params(spec, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 256)
    fn = jax.jit(jax.value_and_grad(lambda p, b, x, y: fmodel.loss(spec, p, b, x, y)[0]))
    if mesh_cfg is None:
        return fn(params, bias, tokens[:, :-1], tokens[:, 1:])
    mesh = make_mesh(mesh_cfg)
    with jax.set_mesh(mesh):
        placed = jax.device_put((params, bias), fmodel.shardings(spec, mesh))
        spec_wkv_b = placed[0]["moe_layers"]["attn"]["wkv_b"].sharding.spec  # [L, C, H, N+U]
        assert (spec_wkv_b[2] == "tensor") == (mesh_cfg.tensor > 1)  # heads split like MHA's
        return fn(*placed, tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize(
    "tensor, sequence_parallel",
    [
        (2, False),
        *(pytest.param(t, sp, marks=pytest.mark.slow) for t, sp in [(1, False), (4, False), (2, True)]),
    ],
)
def test_mla_model_under_tensor_parallelism_equals_one_device(tensor, sequence_parallel) -> None:
    cfg = _tiny_mla()
    par = ParallelConfig(dispatch="dense", sequence_parallel=sequence_parallel)
    loss, grads = _loss_grad(cfg, par, MeshConfig(data=8 // tensor, tensor=tensor))
    loss_ref, grads_ref = _loss_grad(cfg, ParallelConfig(dispatch="dense"), None)
    assert abs(float(loss) - float(loss_ref)) < 1e-5 * float(loss_ref)
    for (path, g), g_ref in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref), strict=True
    ):
        assert rel_err(g, g_ref) < 1e-5, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_mla_fast_backends_match_xla_bf16_gpu(impl) -> None:
    """DeepSeek's head dims (N 128, R 64, U 128, C 512): the fast backend runs (no fallback) and
    its forward and gradients match XLA's in bf16."""
    mla = MLAConfig(
        kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    base = dict(hidden=1024, num_heads=8, num_layers=1, num_dense_layers=1, moe=None, dtype="bfloat16")
    x = jax.random.normal(jax.random.key(0), (2, 512, 1024), jnp.bfloat16)
    q = jnp.zeros((2, 512, 8, 192), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        assert choose(impl, q, q) == impl
    results = {}
    for name in ("xla", impl):
        cfg = ModelConfig(
            **base, attention=name, attention_type="mla", mla=mla, rope_scaling=RopeScalingConfig()
        )
        graphdef, state = nnx.split(MLAttention(cfg, nnx.Rngs(params=0)))
        fwd = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
        loss = lambda s, x, g=graphdef: jnp.sum(nnx.merge(g, s)(x).astype(jnp.float32) ** 2)  # noqa: E731
        results[name] = (fwd(state, x), *jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x))
    for a, b in zip(jax.tree.leaves(results[impl]), jax.tree.leaves(results["xla"]), strict=True):
        assert rel_err(a, b) < 2e-2


def test_mla_config_is_checked_by_name() -> None:
    from xmoe_jax.config import ConfigError

    tiny = CONFIGS / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"attention_type='mla' needs the model\.mla section"):
        load_config(tiny, ["model.attention_type=mla"])
    with pytest.raises(ConfigError, match="model.mla is set but attention_type='mha'"):
        load_config(tiny, ["model.mla.kv_lora_rank=16"])
    with pytest.raises(ConfigError, match="leave num_kv_heads, qkv_bias and qk_norm"):
        load_config(tiny, ["model.attention_type=mla", "model.mla.kv_lora_rank=16"])  # tiny has GQA
    with pytest.raises(ConfigError, match="qk_rope_head_dim=3 must be even"):
        MLAConfig(qk_rope_head_dim=3)
    with pytest.raises(ConfigError, match=r"rope_scaling\.factor=0\.5 must be >= 1"):
        RopeScalingConfig(factor=0.5)
    ok = load_config(
        tiny, ["model.attention_type=mla", "model.mla.kv_lora_rank=16", "model.num_kv_heads=null"]
    )
    assert ok.model.head_size == 128 + 64 and ok.model.value_head_size == 128
