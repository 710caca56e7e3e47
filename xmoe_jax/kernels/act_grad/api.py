"""The expert activation's backward with the routing weight, in one pass over the rows.

Legend: R grouped rows, F expert hidden. For rows of the pre-activation hidden (gate, up) (GELU: up
only), u = d y W_down^T the activation's cotangent before the row's routing weight g:

    d_gate, d_up, wact_RF, s_R = act_grad(hidden, u_RF, g_R, activation)
      d hidden = act'(hidden) (u g)      the up-projections' cotangents
      wact     = act(hidden) g           the down-projection's weight-gradient operand
      s        = sum_F u act             the routing weight's gradient (<dy, out> of the row)

what the combine's backward needs: on one device (moe/experts.py `_act_down_combine`), and after an
exchange, where the weights were folded into the activation (`_act_down_bwd` with row weights). Backends: "xla"
(xla.py: the oracle, CPU) and "pallas" (pallas.py: one kernel, GPU); triton, mgpu and ws hand it to
pallas. Outputs in the hidden's dtype, s in float32; arithmetic in float32.
"""

from __future__ import annotations

from xmoe_jax.kernels import backends
from xmoe_jax.kernels.validation import check_float


def act_grad(hidden: tuple, u_RF, g_R, activation: str, implementation: str | None = None):
    """(d hidden as a tuple like `hidden`, act * g, s) (module docstring)."""
    gate_RF, up_RF = hidden
    if (gate_RF is None) != (activation != "swiglu"):
        raise ValueError(
            f"act_grad: {activation} reads {'(gate, up)' if activation == 'swiglu' else '(None, up)'}"
        )
    for name, a in (("up_RF", up_RF), ("u_RF", u_RF)):
        check_float(name, a)
        if a.shape != up_RF.shape or (gate_RF is not None and gate_RF.shape != up_RF.shape):
            raise ValueError(
                f"act_grad: hidden and u must be one [R, F] shape, got {up_RF.shape} and {a.shape}"
            )
    if g_R.shape != up_RF.shape[:1]:
        raise ValueError(f"act_grad: g_R must be [R] = {up_RF.shape[:1]}, got {g_R.shape}")
    backend = backends.choose_backend(implementation, backends.Call("act_grad", (up_RF, u_RF, up_RF)))
    d_gate, d_up, wact_RF, s_R = backend.act_grad(gate_RF, up_RF, u_RF, g_R, activation)
    return (d_gate, d_up), wact_RF, s_R
