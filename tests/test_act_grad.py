"""The activation's backward with the routing weight in one pass (kernels/act_grad): the Pallas kernel
(interpret mode on CPU) and the XLA reference against float64 NumPy, GELU and SwiGLU, F not a multiple
of the kernel's column chunk, rows with weight 0; and the combine's backward routes through it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xmoe_jax.kernels.act_grad import act_grad

R, F = 37, 200  # not multiples of the kernel's 16 rows or 256 columns


def _numpy(gate, up, u, g, activation):
    gate, up, u, g = (None if a is None else np.asarray(a, np.float64) for a in (gate, up, u, g))
    g = g[:, None]
    if activation == "swiglu":
        sig = 1 / (1 + np.exp(-gate))
        act = gate * sig * up
        d = u * g
        return (d * up * sig * (1 + gate * (1 - sig)), d * gate * sig), act * g, (u * act).sum(1)
    c, a = math.sqrt(2 / math.pi), 0.044715
    t = np.tanh(c * (up + a * up**3))
    act = 0.5 * up * (1 + t)
    slope = 0.5 * (1 + t) + 0.5 * up * (1 - t * t) * c * (1 + 3 * a * up * up)
    return (None, u * g * slope), act * g, (u * act).sum(1)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_act_grad_matches_float64(implementation, activation, dtype):
    keys = jax.random.split(jax.random.key(7), 4)
    gate = jax.random.normal(keys[0], (R, F), dtype) * 2 if activation == "swiglu" else None
    up = jax.random.normal(keys[1], (R, F), dtype) * 2
    u = jax.random.normal(keys[2], (R, F), dtype)
    g = jax.random.uniform(keys[3], (R,)).at[::5].set(0.0)  # unrouted rows weigh 0
    (d_gate, d_up), wact, s = jax.jit(
        lambda *a: act_grad((a[0], a[1]), a[2], a[3], activation, implementation=implementation)
    )(gate, up, u, g)
    (w_gate, w_up), w_act, w_s = _numpy(gate, up, u, g, activation)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert d_up.dtype == wact.dtype == dtype and s.dtype == jnp.float32
    for got, want in ((d_up, w_up), (wact, w_act), (s, w_s)) + (
        ((d_gate, w_gate),) if gate is not None else ()
    ):
        got = np.asarray(got, np.float64)
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), (
            np.abs(got - want).max(),
            np.abs(want).max(),
        )
    assert d_gate is None if gate is None else d_gate.dtype == dtype


def test_act_grad_refuses_mismatched_operands():
    up = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="swiglu reads"):
        act_grad((None, up), up, jnp.zeros(4), "swiglu")
    with pytest.raises(ValueError, match="g_R must be"):
        act_grad((None, up), up, jnp.zeros(5), "gelu")
    with pytest.raises(ValueError, match="one \\[R, F\\] shape"):
        act_grad((None, up), jnp.zeros((4, 9)), jnp.zeros(4), "gelu")
