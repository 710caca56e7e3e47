"""The activation fused into the expert GEMMs (kernels/gmm/fused.py): the Pallas prologue / epilogue
kernels (interpret mode on CPU) and the XLA reference, each against a float64 NumPy statement of
the same product, for SwiGLU and GELU, skewed and empty groups, gathered and scattered rows.

Rows of the hidden past sum(group_sizes) hold NaN: a kernel that read one would spread it into a
valid output or gradient, so these tests fail if the fused loads touch a padding row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xmoe_jax.kernels.gmm import activation as act_mod
from xmoe_jax.kernels.gmm.fused import gmm_act, gmm_act_grad, tgmm_act
from xmoe_jax.kernels.platform import platform

R, F, D, E, O_ROWS = (
    44,
    24,
    20,
    3,
    50,
)  # grouped rows, hidden, model, experts, output rows (F, D not tile multiples)
TILE = (16, 16, 16)
SIZES = ([9, 0, 21], [30, 2, 0], [0, 0, 0], [44, 0, 0])  # S < R, empty experts, nothing routed, S = R


def _act64(g, u, activation):
    if activation == "swiglu":
        return g / (1 + np.exp(-g)) * u
    return 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))


def _case(seed, sizes, activation):
    n = act_mod.num_matrices(activation)
    rng = np.random.default_rng(seed)
    s = sum(sizes)
    hidden = rng.standard_normal((R, n * F)).astype(np.float32)
    hidden[s:] = np.nan  # padding rows: never read
    w = (rng.standard_normal((E, F, D)) / np.sqrt(F)).astype(np.float32)
    dst = rng.permutation(O_ROWS)[:R].astype(np.int32)  # distinct output rows
    dy = rng.standard_normal((O_ROWS, D)).astype(np.float32)
    group = np.repeat(np.arange(E), sizes)
    return hidden, w, dst, dy, group, s


def _split64(hidden, activation):
    h = hidden.astype(np.float64)
    return (h[:, :F], h[:, F:]) if activation == "swiglu" else (None, h)


def _fns(impl, activation):
    def fwd(h, w, gs, dst):
        return gmm_act(
            h, w, gs, activation, out_rows_R=dst, num_out_rows=O_ROWS, implementation=impl, tile=TILE
        )

    def dgrad(dy, w, gs, h, src):
        return gmm_act_grad(dy, w, gs, h, activation, lhs_rows_R=src, implementation=impl, tile=TILE)

    def wgrad(h, dy, gs, src):
        return tgmm_act(h, dy, gs, activation, grad_rows_R=src, implementation=impl, tile=TILE)

    return jax.jit(fwd), jax.jit(dgrad), jax.jit(wgrad)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "a padding row (NaN) was read"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_fused_activation_gemms_match_float64(impl, activation, monkeypatch):
    monkeypatch.setenv("XMOE_FUSED_ACT", "kernel")  # every op fused where the backend is Pallas
    fwd, dgrad, wgrad = _fns(impl, activation)
    # XLA's float32 dots on a GPU round through TF32; the kernels' are full float32 (HIGHEST)
    tol = 1e-5 if impl == "pallas" or platform() == "cpu" else 3e-3
    for seed, sizes in enumerate(SIZES):
        hidden, w, dst, dy, group, s = _case(seed, sizes, activation)
        gs = jnp.asarray(sizes, jnp.int32)
        gate, up = _split64(hidden[:s], activation)
        act = _act64(gate, up, activation)  # [S, F]
        w64, dy64 = w.astype(np.float64), dy.astype(np.float64)

        out = np.asarray(fwd(hidden, w, gs, dst), np.float64)[dst[:s]]
        want = np.einsum("rf,rfd->rd", act, w64[group])
        assert s == 0 or _rel(out, want) < tol, (seed, "forward")

        d_act = np.einsum("rd,rfd->rf", dy64[dst[:s]], w64[group])
        if activation == "swiglu":
            sig = 1 / (1 + np.exp(-gate))
            want_dh = np.concatenate([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], axis=1)
        else:
            t = np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up**3))
            slope = 0.5 * (1 + t) + 0.5 * up * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * up**2)
            want_dh = d_act * slope
        dh = np.asarray(dgrad(dy, w, gs, hidden, dst), np.float64)[:s]
        assert s == 0 or _rel(dh, want_dh) < tol, (seed, "d hidden")

        dw = np.asarray(wgrad(hidden, dy, gs, dst), np.float64)
        want_dw = np.zeros((E, F, D))
        np.add.at(want_dw, group, np.einsum("rf,rd->rfd", act, dy64[dst[:s]]))
        assert np.all(np.isfinite(dw)) and np.linalg.norm(dw - want_dw) <= tol * max(
            np.linalg.norm(want_dw), 1
        )


def test_the_activation_gradient_is_the_autodiff_one():
    """activation.py's hand-written gradient against jax.vjp of its own forward."""
    rng = np.random.default_rng(7)
    g, u, d = (jnp.asarray(rng.standard_normal((5, 6)), jnp.float32) for _ in range(3))
    for activation in ("swiglu", "gelu"):
        gate = g if activation == "swiglu" else None
        _, vjp = jax.vjp(lambda a, b: act_mod.act_f32(a, b, "swiglu"), g, u)
        want = vjp(d) if activation == "swiglu" else (None, jax.vjp(lambda b: jax.nn.gelu(b), u)[1](d)[0])
        got = act_mod.act_grad_f32(gate, u, d, activation)
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or np.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.allclose(act_mod.act_f32(None, u, "gelu"), jax.nn.gelu(u), rtol=1e-6, atol=1e-6)


def test_fused_argument_errors_name_the_shapes():
    h, w, gs = jnp.ones((8, 10)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"hidden must be \[R, 2 \* F\] = \[R, 8\] for swiglu with F = 4"):
        gmm_act(h, w, gs, "swiglu")
    with pytest.raises(ValueError, match="activation must be one of"):
        gmm_act(h, w, gs, "relu")
    with pytest.raises(ValueError, match="hidden has 8 rows, the grouped rows are 6"):
        gmm_act_grad(jnp.ones((6, 3)), w, gs, jnp.ones((8, 8)), "swiglu")


def test_the_fused_activation_modes_name_the_ops_or_are_refused(monkeypatch):
    """XMOE_FUSED_ACT overrides the default mode of kernels/gmm/fused.py."""
    from xmoe_jax.kernels import defaults

    ops = ("gmm_act", "gmm_act_grad", "tgmm_act")
    for mode, fused in (("kernel", ops), ("grad", ("gmm_act_grad",)), ("xla", ())):
        monkeypatch.setenv("XMOE_FUSED_ACT", mode)
        assert tuple(op for op in ops if defaults.activation_in_kernel(op)) == fused, mode
    monkeypatch.setenv("XMOE_FUSED_ACT", "fast")
    with pytest.raises(ValueError, match="use one of"):
        defaults.activation_in_kernel("gmm_act")


def test_the_epilogue_refuses_a_scattered_or_filled_output():
    from xmoe_jax.kernels.gmm.pallas import gmm_pallas

    dy, w, gs, h = jnp.ones((6, 3)), jnp.ones((2, 4, 3)), jnp.array([3, 3], jnp.int32), jnp.ones((6, 8))
    rows = jnp.arange(6, dtype=jnp.int32)
    with pytest.raises(ValueError, match="act_grad stores the grouped rows"):
        gmm_pallas(dy, w, gs, out_dtype=jnp.float32, tile=(16, 16, 16), transpose_rhs=True, out_rows_R=rows,
                   num_out_rows=6, act_grad=("swiglu", h), interpret=True)  # fmt: skip
