"""FP8 (xmoe_jax.fp8): quantization against float64 NumPy references, the edge cases the module
docstrings promise (saturation, all-zero and huge tiles, NaN/inf), and the FP8 grouped GEMM and
dense dot against a float64 GEMM of operands quantized by an independent NumPy emulation of the
recipe (scales computed in float32 as the recipe defines them; the product in float64).

The Pallas kernel runs in interpret mode on CPU, where XLA:CPU upcasts its fp8 dots: that
checks the kernel's indexing, masking and scale placement, not the Triton FP8 lowering, which
the `gpu`-marked test (and scripts/bench_fp8.py --check) checks on a GPU.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from xmoe_jax.fp8 import RECIPES, Recipe, dot_fp8, fp8_dtype, gmm_fp8
from xmoe_jax.fp8 import dequantize as _dequantize
from xmoe_jax.fp8 import quantize as _quantize
from xmoe_jax.fp8.formats import max_value
from xmoe_jax.fp8.operands import quantize_lhs, quantize_rhs
from xmoe_jax.kernels import IMPLEMENTATIONS, backends

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
SLOW = pytest.mark.slow
quantize = jax.jit(_quantize, static_argnums=(1, 2))  # one compiled program, not one per eager op
dequantize = jax.jit(_dequantize, static_argnums=(2, 3))


def _tiered(values, default):
    """pytest params: `default` in the default suite, the others marked slow (seconds each on CPU)."""
    return [pytest.param(v, marks=() if v == default else SLOW) for v in values]


# ---------------------------------------------------------------- NumPy references


def np_quantize(x: np.ndarray, block, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 payload as float64, float64 scales): loops over tiles, float32 scale arithmetic."""
    shape = x.shape
    sizes = [d if b is None else min(b, d) for d, b in zip(shape, block, strict=True)]
    counts = [-(-d // s) for d, s in zip(shape, sizes, strict=True)]
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    q = np.zeros(shape)
    scales = np.zeros(counts)
    for idx in np.ndindex(*counts):
        sl = tuple(slice(i * s, (i + 1) * s) for i, s in zip(idx, sizes, strict=True))
        tile = x[sl].astype(np.float32)
        amax = np.float32(np.max(np.abs(tile)))
        if not np.isfinite(amax):
            scale = np.float32(np.nan)
        else:
            scale = amax * np.float32(1.0 / fmax) if amax > 0 else np.float32(1.0)
        scales[idx] = scale
        q[sl] = np.clip(tile / scale, -fmax, fmax).astype(dtype).astype(np.float64)
    return q, scales


def np_fake_quantize(x, block, dtype) -> np.ndarray:
    q, s = np_quantize(np.asarray(x, np.float32), block, dtype)
    sizes = [d if b is None else min(b, d) for d, b in zip(x.shape, block, strict=True)]
    full = s
    for axis, size in enumerate(sizes):
        full = np.repeat(full, size, axis=axis)
    return q * full[tuple(slice(0, d) for d in x.shape)]


def np_gmm(lhs, rhs, group_sizes) -> np.ndarray:
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[e]
        start += size
    return out


def _rand(shape, seed, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


# ---------------------------------------------------------------- quantize


BLOCKS = [(None, None), (1, None), (1, 128), (128, 128), (4, 48)]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_quantize_matches_numpy_reference(block, kind):
    dtype = fp8_dtype(kind, "cuda")
    x = _rand((40, 300), 0) * np.exp(_rand((40, 300), 1))  # values over several binades
    q, s = quantize(jnp.asarray(x), block, dtype)
    q_ref, s_ref = np_quantize(x, block, dtype)
    assert q.dtype == dtype and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s, np.float64), s_ref)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32), np.float64), q_ref)


@pytest.mark.parametrize("block", BLOCKS)
def test_round_trip_error_is_within_half_an_fp8_step(block):
    x = jnp.asarray(_rand((32, 256), 2))
    q, s = quantize(x, block, E4M3)
    back = np.asarray(dequantize(q, s, block), np.float64)
    from xmoe_jax.fp8.quantize import expand_scale

    scale = np.asarray(expand_scale(s, x.shape, block), np.float64)
    xf = np.asarray(x, np.float64)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, <= 2^-10 * scale for subnormals
    assert np.all(np.abs(back - xf) <= 2.0**-4 * np.abs(xf) + 2.0**-10 * scale)


def test_all_zero_tile_gets_scale_one_and_no_nan():
    x = jnp.zeros((4, 256)).at[0, 200].set(3.0)
    q, s = quantize(x, (1, 128), E4M3)
    s_ref = [[1.0, 3.0 / 448.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-6)
    back = dequantize(q, s, (1, 128))
    assert np.all(np.isfinite(np.asarray(back)))
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-6)


def test_huge_and_tiny_tiles_keep_their_range():
    x = jnp.asarray(np.stack([_rand(128, 3) * 1e30, _rand(128, 4) * 1e-30]), jnp.float32)
    q, s = quantize(x, (1, 128), E4M3)
    back = np.asarray(dequantize(q, s, (1, 128)), np.float64)
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back, np.asarray(x, np.float64), rtol=2.0**-4, atol=0)


def test_overflow_saturates_instead_of_wrapping():
    """float8_e4m3fn has no inf: an unclipped cast of 1000 is NaN. With a scale from another
    tensor (here: scale 1), quantize clips to +-448 first."""
    assert np.isnan(float(jnp.asarray(1000.0).astype(E4M3).astype(jnp.float32)))
    from xmoe_jax.fp8.quantize import expand_scale  # noqa: F401  (the public pieces quantize uses)

    x = jnp.asarray([[1000.0, -1e6, 3.0, 448.0]])
    q, s = quantize(x, (None, None), E4M3)  # scale = 1e6 / 448: nothing overflows
    assert np.all(np.isfinite(np.asarray(q.astype(jnp.float32))))
    clipped = jnp.clip(x / 1.0, -448, 448).astype(E4M3)  # what quantize does with a fixed scale
    assert np.asarray(clipped.astype(jnp.float32)).tolist() == [[448.0, -448.0, 3.0, 448.0]]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_make_their_tile_nan_and_leave_others_alone(bad):
    x = jnp.asarray(_rand((2, 256), 5)).at[0, 5].set(bad)
    q, s = quantize(x, (1, 128), E4M3)
    s = np.asarray(s)
    assert np.isnan(s[0, 0]) and np.all(np.isfinite(s.ravel()[1:]))
    back = np.asarray(dequantize(q, s, (1, 128)))
    assert np.all(np.isnan(back[0, :128]))
    assert np.all(np.isfinite(back[0, 128:])) and np.all(np.isfinite(back[1]))


def test_formats_follow_the_platform():
    assert fp8_dtype("e4m3", "cuda") == jnp.float8_e4m3fn
    assert fp8_dtype("e5m2", "cuda") == jnp.float8_e5m2
    assert fp8_dtype("e4m3", "rocm") == jnp.float8_e4m3fnuz
    assert fp8_dtype("e5m2", "rocm") == jnp.float8_e5m2fnuz
    assert max_value(fp8_dtype("e4m3", "rocm")) == 240.0 and max_value(E4M3) == 448.0
    assert Recipe("rowwise", platform="rocm").act_dtype == jnp.float8_e4m3fnuz
    q, s = quantize(jnp.asarray([[480.0, 1.0]]), (1, None), jnp.float8_e4m3fnuz)
    assert float(s[0, 0]) == pytest.approx(2.0)  # 480 / 240


def test_recipe_errors_name_the_choice():
    with pytest.raises(ValueError, match="recipe must be one of"):
        Recipe("delayed")
    with pytest.raises(ValueError, match="grad_format"):
        Recipe("rowwise", grad_format="e3m4")


# ---------------------------------------------------------------- FP8 grouped GEMM and dense dot

R, K, N, E = 72, 384, 40, 4  # K: 3 blocks of 128 (the FP8 kernel needs K % block_k == 0)
GROUPS = [[20, 0, 33, 9], [72, 0, 0, 0]]  # an empty group; all in one; sum < R (10 zero rows)
FP8_BACKENDS = [
    pytest.param(
        b, marks=pytest.mark.skipif(bool(r := IMPLEMENTATIONS[b].unavailable_reason()), reason=str(r))
    )
    for b in ("xla", "pallas")
]


def _reference(x, w, gs, recipe: Recipe, lhs_dtype=None):
    # rows past the groups take no part in the scales (fp8/gmm.py zeroes them before quantizing)
    x = np.where((np.arange(x.shape[0]) < np.sum(gs))[:, None], x, 0)
    lhs = np_fake_quantize(x, recipe.lhs_block(), lhs_dtype or recipe.act_dtype)
    rhs = np_fake_quantize(w, recipe.rhs_block(), recipe.act_dtype)
    return np_gmm(lhs, rhs, gs)


@pytest.mark.parametrize("impl", FP8_BACKENDS)
@pytest.mark.parametrize("name", _tiered(RECIPES, "blockwise"))
@pytest.mark.parametrize("gs", [GROUPS[0], pytest.param(GROUPS[1], marks=SLOW)])
def test_gmm_fp8_matches_float64_reference(impl, name, gs):
    recipe = Recipe(name, platform="cuda")
    x, w = _rand((R, K), 10), _rand((E, K, N), 11, 0.05)
    gs = np.asarray(gs, np.int32)
    out = gmm_fp8(jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs), recipe, implementation=impl,
                  tile=(16, 128, 16) if impl == "pallas" else None, zero_unwritten=True)  # fmt: skip
    ref = _reference(x, w, gs, recipe)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert np.all(np.asarray(out)[gs.sum() :] == 0)


@pytest.mark.parametrize("name", _tiered(RECIPES, "blockwise"))
def test_gmm_fp8_gradients_follow_the_recipe(name):
    """d lhs = fp8(grad) @ fp8(rhs^T) with grad in grad_format, d rhs = lhs^T @ grad unquantized."""
    recipe = Recipe(name, grad_format="e5m2", platform="cuda")
    x, w, g = _rand((R, K), 12), _rand((E, K, N), 13, 0.05), _rand((R, N), 14)
    gs = np.asarray(GROUPS[0], np.int32)

    def grads(a, b, c):
        return jax.vjp(lambda a, b: gmm_fp8(a, b, jnp.asarray(gs), recipe), a, b)[1](c)

    dx, dw = jax.jit(grads)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    w_t = np.swapaxes(w, 1, 2)
    dx_ref = _reference(g, w_t, gs, recipe, lhs_dtype=recipe.grad_dtype)
    np.testing.assert_allclose(
        np.asarray(dx, np.float64), dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max()
    )
    dw_ref = np.zeros_like(w, dtype=np.float64)
    start = 0
    for e, size in enumerate(gs):
        dw_ref[e] = x[start : start + size].astype(np.float64).T @ g[start : start + size]
        start += size
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), dw_ref, rtol=1e-4, atol=1e-4 * np.abs(dw_ref).max()
    )


@pytest.mark.parametrize("name", _tiered(RECIPES, "rowwise"))
def test_dot_fp8_matches_float64_reference_and_its_gradient(name):
    recipe = Recipe(name, platform="cuda")
    x, w, g = _rand((3, 24, K), 15), _rand((K, N), 16, 0.05), _rand((3, 24, N), 17)

    def run(a, b, c):
        out, vjp = jax.vjp(lambda a, b: dot_fp8(a, b, recipe), a, b)
        return out, *vjp(c)

    out, dx, dw = jax.jit(run)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    ref = _reference(x.reshape(-1, K), w[None], [72], recipe).reshape(3, 24, N)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    dx_ref = _reference(g.reshape(-1, N), w.T[None], [72], recipe, recipe.grad_dtype).reshape(x.shape)
    np.testing.assert_allclose(
        np.asarray(dx, np.float64), dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max()
    )
    dw_ref = x.reshape(-1, K).astype(np.float64).T @ g.reshape(-1, N)
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), dw_ref, rtol=1e-4, atol=1e-4 * np.abs(dw_ref).max()
    )


def test_fp8_is_close_to_the_unquantized_product():
    """The accuracy cost in numbers: e4m3 operands give about 2-5% max relative error per GEMM."""
    x, w = jnp.asarray(_rand((64, 512), 18)), jnp.asarray(_rand((512, 64), 19, 0.05))
    exact = np.asarray(x @ w)
    for name in RECIPES:
        got = jax.jit(dot_fp8, static_argnums=2)(x, w, Recipe(name))
        err = np.abs(np.asarray(got) - exact).max() / np.abs(exact).max()
        assert err < 0.05, (name, err)


def test_registry_says_why_a_backend_cannot_take_an_fp8_call():
    q = jax.ShapeDtypeStruct((64, 256), E4M3)
    call = backends.Call("gmm_fp8", (q,), 256, 64, (64, 64, 64), 128)
    assert "block_k" in backends.IMPLEMENTATIONS["pallas"].shape_reason(call)
    assert "FP8" in backends.IMPLEMENTATIONS["triton"].shape_reason(call)
    assert "bf16/f16" in backends.IMPLEMENTATIONS["mgpu"].shape_reason(call)
    ragged_k = backends.Call("gmm_fp8", (q,), 300, 64, (64, 128, 64), 128)
    assert "multiple of" in backends.IMPLEMENTATIONS["pallas"].shape_reason(ragged_k)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert backends.choose_backend("pallas", call).name in ("xla", "pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("name", RECIPES)
def test_gmm_fp8_kernel_matches_oracle_on_gpu(name):
    recipe = Recipe(name)
    x, w = _rand((1024, 2048), 20), _rand((8, 2048, 1408), 21, 0.02)
    gs = jnp.asarray([300, 0, 200, 100, 100, 124, 100, 50], jnp.int32)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), gs, recipe)
    got = np.asarray(gmm_fp8(*args, implementation="pallas", zero_unwritten=True), np.float64)
    ref = np.asarray(gmm_fp8(*args, implementation="xla"), np.float64)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=1e-2 * np.abs(ref).max())


def test_operands_layouts():
    lhs, rhs = jax.ShapeDtypeStruct((5, 300), jnp.float32), jax.ShapeDtypeStruct((2, 300, 200), jnp.float32)
    want = {
        "blockwise": ((5, 3), (2, 3, 200)),
        "rowwise": ((5, 1), (2, 1, 200)),
        "tensorwise": ((5, 1), (2, 1, 200)),
    }
    for name, (lhs_s, rhs_s) in want.items():
        recipe = Recipe(name)
        q, s = jax.eval_shape(lambda x, r=recipe: quantize_lhs(x, r, E4M3), lhs)
        assert q.shape == (5, 300) and q.dtype == E4M3 and s.shape == lhs_s
        q, s = jax.eval_shape(lambda w, r=recipe: quantize_rhs(w, r, E4M3), rhs)
        assert q.shape == (2, 300, 200) and s.shape == rhs_s


def _export_for_cuda(fn, args):
    """`fn` exported for an H100 from this CPU host. jax 0.12's Pallas Triton lowering reads the GPU's
    kind from the device or from an abstract mesh's AbstractDevice, so we name one."""
    from jax import export
    from jax._src.mesh import AbstractDevice  # the public alias is still missing in jax 0.12

    h100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda")
    skip = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        return export.export(fn, platforms=["cuda"], disabled_checks=skip)(*args)


@pytest.mark.parametrize("case", ["blockwise", "rowwise_kmajor", "mixed_e5m2"])
def test_fp8_kernel_lowers_through_triton_for_cuda(case):
    """The Pallas FP8 kernel's Triton lowering, run on CPU by exporting for the cuda platform (the
    PTX compile itself needs a GPU: scripts/bench_fp8.py --check)."""

    from xmoe_jax.kernels.gmm.pallas_fp8 import gmm_fp8_pallas

    kb, transpose = (1, True) if case == "rowwise_kmajor" else (4, False)
    lhs_dt = jnp.float8_e5m2 if case == "mixed_e5m2" else E4M3
    sds = jax.ShapeDtypeStruct
    args = (sds((256, 512), lhs_dt), sds((256, kb), jnp.float32),
            sds((4, 384, 512) if transpose else (4, 512, 384), E4M3), sds((4, kb, 384), jnp.float32),
            sds((4,), jnp.int32))  # fmt: skip
    fn = jax.jit(lambda *a: gmm_fp8_pallas(*a, out_dtype=jnp.bfloat16, tile=(128, 128, 256),
                                           transpose_rhs=transpose, num_warps=8, num_stages=4))  # fmt: skip
    assert "xla.gpu.triton" in _export_for_cuda(fn, args).mlir_module()


@pytest.mark.parametrize(
    "recipe, want",
    [(Recipe("rowwise"), 128), (Recipe("rowwise", fast_accum=True), 1 << 30), (Recipe("blockwise"), 128)],
)
def test_fp8_kernel_tells_triton_how_long_to_accumulate_in_the_tensor_core(monkeypatch, recipe, want):
    """The kernel's tt.dot carries maxNumImpreciseAcc from the recipe (kernels/gmm/fp8_dot.py): Pallas's
    plain dot leaves it 0, a float32 add after every wgmma, which ran the kernel at 0.55x bf16."""
    from jax._src.pallas.triton import lowering

    from xmoe_jax.kernels.gmm.pallas_fp8 import gmm_fp8_pallas

    seen = []
    real_dot = lowering.tt_dialect.dot

    def spy(*args, **kwargs):
        seen.append(kwargs.get("max_num_imprecise_acc"))
        return real_dot(*args, **kwargs)

    monkeypatch.setattr(lowering.tt_dialect, "dot", spy)
    kb = 4 if recipe.block_k else 1
    sds = jax.ShapeDtypeStruct
    args = (sds((256, 512), E4M3), sds((256, kb), jnp.float32), sds((4, 384, 512), E4M3),
            sds((4, kb, 384), jnp.float32), sds((4,), jnp.int32))  # fmt: skip
    fn = jax.jit(lambda *a: gmm_fp8_pallas(*a, out_dtype=jnp.bfloat16, tile=(128, 128, 128), transpose_rhs=True,
                                           num_warps=8, num_stages=3, imprecise_acc=recipe.imprecise_acc))  # fmt: skip
    _export_for_cuda(fn, args)
    assert seen == [want]


def test_kmajor_weights_and_fast_accum_match_the_reference(monkeypatch):
    """The CUDA layout (weights transposed to K-major where they are quantized, kernel with
    transpose_rhs), forced on this CPU in interpret mode, forward and dgrad, with the recipe's
    fast_accum carried to the kernel: same numbers as the float64 emulation of the recipe."""
    from xmoe_jax.kernels import defaults

    monkeypatch.setitem(defaults.FP8_WEIGHTS_KMAJOR, "cpu", True)
    recipe = Recipe("rowwise", fast_accum=True, platform="cuda")
    n = 128  # dgrad contracts over N: a multiple of block_k, so both GEMMs take the kernel
    x, w, g = _rand((R, K), 15), _rand((E, K, n), 16, 0.05), _rand((R, n), 17)
    gs = np.asarray(GROUPS[0], np.int32)

    def fwd_dgrad(a, b, c):
        out, vjp = jax.vjp(lambda a: gmm_fp8(a, b, jnp.asarray(gs), recipe, implementation="pallas",
                                             tile=(16, 128, 16), zero_unwritten=True), a)  # fmt: skip
        return out, vjp(c)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the xla oracle warns
        out, dx = jax.jit(fwd_dgrad)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    for got, ref in (
        (out, _reference(x, w, gs, recipe)),
        (dx, _reference(g, np.swapaxes(w, 1, 2), gs, recipe)),
    ):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


PFT = "parallel.dispatch=pft"  # the routed experts' FP8 GEMMs need a grouped-GEMM dispatch


def test_fast_accum_is_a_config_choice():
    from xmoe_jax.config import load_config
    from xmoe_jax.fp8 import context

    cfg = load_config("configs/tiny.yaml", ["model.fp8={recipe: rowwise, fast_accum: true}", PFT])
    with context.use(cfg.model.fp8):
        assert context.recipe_for("experts").imprecise_acc == 1 << 30
    with context.use(load_config("configs/tiny.yaml", ["model.fp8={recipe: rowwise}", PFT]).model.fp8):
        assert context.recipe_for("experts").imprecise_acc == 128


def test_loss_curve_runs_name_their_fp8_settings():
    from xmoe_jax.perf.fp8_curve import fp8_override

    assert fp8_override("off") == "model.fp8=null"
    assert fp8_override("blockwise") == "model.fp8={recipe: blockwise}"
    assert fp8_override("rowwise+fast_accum") == "model.fp8={recipe: rowwise, fast_accum: true}"
    with pytest.raises(ValueError, match="fast_accum"):
        fp8_override("rowwise+fast")
