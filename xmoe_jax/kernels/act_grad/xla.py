"""XLA reference of `act_grad` (api.py): the oracle of act_grad/pallas.py and its CPU path.

Legend: R grouped rows, F expert hidden. Arithmetic in float32 (gmm/activation.py's expressions, which
the Pallas kernel evaluates alike); outputs in the hidden's dtype, s_R in float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from xmoe_jax.kernels.gmm.activation import act_f32, act_grad_f32


def act_grad_xla(gate_RF, up_RF, u_RF, g_R, activation: str):
    """(d gate or None, d up, act * g, s) for rows of hidden (gate, up), d act before the weight u and
    the row weights g: d hidden = act'(hidden) (u g), s = sum_F u act."""
    act = act_f32(gate_RF, up_RF, activation)
    u = u_RF.astype(jnp.float32)
    g = g_R.astype(jnp.float32)[:, None]
    d_gate, d_up = act_grad_f32(gate_RF, up_RF, u * g, activation)
    dt = up_RF.dtype
    return (
        None if d_gate is None else d_gate.astype(dt),
        d_up.astype(dt),
        (act * g).astype(dt),
        jnp.sum(u * act, axis=1),
    )
