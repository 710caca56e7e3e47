"""The expert activation and its gradient, written once for the fused GEMMs and their XLA reference.

Legend: R grouped rows, F expert hidden, H = n * F the concatenated hidden (n = 2 for SwiGLU: gate
columns [0, F) then up columns [F, 2F); n = 1 for GELU: up only).

    act   = act_f32(gate, up, activation)            # SwiGLU silu(gate) * up; GELU gelu(up)
    d_gate, d_up = act_grad_f32(gate, up, d_act, activation)

Plain float32 element-wise jnp (exp, tanh, division): the same expression lowers inside a Pallas
Triton kernel (a GEMM's prologue or epilogue, pallas.py) and in XLA, so the kernel and its
reference compute alike. GELU is the tanh form (`jax.nn.gelu`'s default). Masked kernel loads read
zeros, and act(0, 0) = 0, so a masked row contributes nothing to a GEMM.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

ACTIVATIONS = {"swiglu": 2, "gelu": 1}  # activation -> n, the hidden matrices it reads
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def num_matrices(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _tanh(x):
    """tanh through one exp and a division (exact at +-inf, 1e-7 absolute near 0). Written so, XLA
    makes act_grad's GELU one fused pass on an H200 (1.53 ms against 2.87 with jnp.tanh); the Pallas
    kernel was slow with either form (benchmarks/kernels.md)."""
    return 2.0 / (1.0 + jnp.exp(-2.0 * x)) - 1.0


def act_f32(gate, up, activation: str):
    """silu(gate) * up, or gelu(up) (gate None), in float32."""
    up = up.astype(jnp.float32)
    if activation == "swiglu":
        gate = gate.astype(jnp.float32)
        return gate * _sigmoid(gate) * up
    t = _tanh(_GELU_C * (up + _GELU_A * up * up * up))
    return 0.5 * up * (1.0 + t)


def act_grad_f32(gate, up, d_act, activation: str):
    """(d gate, d up) of act_f32 given its cotangent d_act, in float32 (d gate None for GELU)."""
    up, d_act = up.astype(jnp.float32), d_act.astype(jnp.float32)
    if activation == "swiglu":
        gate = gate.astype(jnp.float32)
        s = _sigmoid(gate)
        return d_act * up * s * (1.0 + gate * (1.0 - s)), d_act * gate * s
    inner = _GELU_C * (up + _GELU_A * up * up * up)
    t = _tanh(inner)
    slope = 0.5 * (1.0 + t) + 0.5 * up * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * up * up)
    return None, d_act * slope


def split_hidden(hidden_RH, activation: str):
    """(gate [R, F] or None, up [R, F]) of a concatenated hidden."""
    if num_matrices(activation) == 1:
        return None, hidden_RH
    f_dim = hidden_RH.shape[1] // 2
    return hidden_RH[:, :f_dim], hidden_RH[:, f_dim:]


def act_rows(hidden_RH, activation: str):
    """act(hidden) [R, F] in the hidden's dtype (computed in float32): the XLA reference's operand."""
    return act_f32(*split_hidden(hidden_RH, activation), activation).astype(hidden_RH.dtype)


def act_grad_rows(hidden_RH, d_act_RF, activation: str):
    """d hidden [R, H] in the hidden's dtype: the concatenated (d gate, d up) of act_rows."""
    d_gate, d_up = act_grad_f32(*split_hidden(hidden_RH, activation), d_act_RF, activation)
    parts = [d_up] if d_gate is None else [d_gate, d_up]
    return jnp.concatenate(parts, axis=1).astype(hidden_RH.dtype)
