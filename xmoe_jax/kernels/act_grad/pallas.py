"""`act_grad` (api.py) as one Triton-style Pallas kernel (GPU: Triton lowering; CPU: interpret).

Legend: R grouped rows, F expert hidden; br rows and bf columns per chunk. One program reads a block
of br rows of the hidden (gate and up, or up) and of u once, chunk by chunk along F, and writes d
hidden, act * g and the row sums s = sum_F u act: every input byte read once, every output byte
written once. XLA splits the same expressions into two passes, the first of which writes act and
its tanh for the second to read back (benchmarks/train_step.md). Arrays are passed flat and
addressed as row * F + column (masked: any F); float32 arithmetic (gmm/activation.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xmoe_jax.kernels.gmm.activation import act_f32, act_grad_f32
from xmoe_jax.kernels.permute.pallas import _store  # masked flat stores, safe in interpret mode

# rows and columns per chunk, warps (any value is correct; scripts/bench_act_grad.py times them)
BLOCKS = dict(block_rows=16, block_f=256, num_warps=4)


def _kernel(*refs, num_rows, f_dim, br, bf, gated, interpret):
    if gated:
        gate_ref, up_ref, u_ref, g_ref, dgate_ref, dup_ref, wact_ref, s_ref = refs
    else:
        up_ref, u_ref, g_ref, dup_ref, wact_ref, s_ref = refs
    rows = pl.program_id(0) * br + jnp.arange(br)
    row_ok = rows < num_rows
    g = plgpu.load(g_ref.at[rows], mask=row_ok, other=0.0).astype(jnp.float32)[:, None]
    s = jnp.zeros((br,), jnp.float32)
    for c0 in range(0, f_dim, bf):  # static chunks along F
        cols = c0 + jnp.arange(bf)
        mask = row_ok[:, None] & (cols < f_dim)[None, :]
        addr = rows[:, None] * f_dim + cols[None, :]
        up = plgpu.load(up_ref.at[addr], mask=mask, other=0).astype(jnp.float32)
        gate = plgpu.load(gate_ref.at[addr], mask=mask, other=0).astype(jnp.float32) if gated else None
        u = plgpu.load(u_ref.at[addr], mask=mask, other=0).astype(jnp.float32)
        act = act_f32(gate, up, "swiglu" if gated else "gelu")
        d_gate, d_up = act_grad_f32(gate, up, u * g, "swiglu" if gated else "gelu")
        s += jnp.sum(u * act, axis=1)
        _store(dup_ref, addr, d_up.astype(dup_ref.dtype), mask, interpret)
        if gated:
            _store(dgate_ref, addr, d_gate.astype(dgate_ref.dtype), mask, interpret)
        _store(wact_ref, addr, (act * g).astype(wact_ref.dtype), mask, interpret)
    _store(s_ref, rows, s, row_ok, interpret)


def act_grad_pallas(gate_RF, up_RF, u_RF, g_R, activation: str, *, block_rows=16, block_f=256, num_warps=None,
                    interpret=False):  # fmt: skip
    """(d gate or None, d up, act * g, s): xla.act_grad_xla's results, in one pass."""
    num_rows, f_dim = up_RF.shape
    gated = activation == "swiglu"
    dt = up_RF.dtype
    bf = min(block_f, pl.next_power_of_2(f_dim))
    kernel = functools.partial(
        _kernel, num_rows=num_rows, f_dim=f_dim, br=block_rows, bf=bf, gated=gated, interpret=interpret
    )
    flat = jax.ShapeDtypeStruct((num_rows * f_dim,), dt)
    out_shape = ([flat] if gated else []) + [flat, flat, jax.ShapeDtypeStruct((num_rows,), jnp.float32)]
    ins = ([gate_RF.reshape(-1)] if gated else []) + [
        up_RF.reshape(-1),
        u_RF.reshape(-1),
        g_R.astype(jnp.float32),
    ]
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(pl.cdiv(num_rows, block_rows),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        name="xmoe_act_grad",
    )(*ins)
    *d_hidden, wact, s_R = outs
    d_gate = d_hidden[0].reshape(num_rows, f_dim) if gated else None
    return d_gate, d_hidden[-1].reshape(num_rows, f_dim), wact.reshape(num_rows, f_dim), s_R
