"""Permute / combine / gather-dot as Triton-style Pallas kernels (GPU: Triton lowering; CPU: interpret).

Legend: T tokens, D model, K top-k, A = T*K copies, R rows of the expert-sorted buffer;
bt/br rows and bd columns per program.

  scatter_rows  out[dest[t,k]] = x[t] * scale[t,k]   (permute; combine's dgrad)
  combine_rows  out[t]   = sum_k w[t,k] * y[dest[t,k]]   (combine; permute's dgrad)
  gather_dot    out[t,k] = a[t] . b[dest[t,k]]           (d weights of both)

Each moves the fewest bytes: every input row is read once and every output row written once,
with no atomics. scatter_rows reads a token tile once and writes its K copies to their
(distinct) rows, and zero-fills the rows nobody fills in the same launch; combine and
gather-dot read buffer rows through an index vector. Arrays are passed flattened to 1-D and
addressed as row * D + column, which the Triton lowering turns into masked vector accesses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Block sizes and warps per kernel (GPU-tuned by scripts/bench_gmm.py --sweep; any value is correct).
BLOCKS = {
    "scatter_rows": dict(block_tokens=8, block_rows=64, block_d=512, num_warps=4),
    "combine_rows": dict(block_tokens=8, block_d=512, num_warps=4),
    "gather_dot": dict(block_tokens=8, block_d=512, num_warps=8),
}


def _block_d(dim: int, block_d: int) -> int:
    return min(block_d, pl.next_power_of_2(dim))


def _store(ref, addr, val, mask, interpret: bool):
    """Masked store to flat addresses. Masked lanes touch no memory on a GPU, but interpret mode
    writes their old value back, which could race a real write to the same address (a masked
    column past D aliases the next row): there they aim past the end, where writes are dropped."""
    if interpret:
        addr = jnp.where(mask, addr, ref.shape[0])
    plgpu.store(ref.at[addr], val, mask=mask)


def _scatter_rows_kernel(
    dest_ref, scale_ref, filled_ref, x_ref, out_ref, *, num_tokens, num_rows, dim, top_k, bt, br, bd,
    token_programs, interpret,
):  # fmt: skip
    d_tiles = pl.cdiv(dim, bd)
    pid = pl.program_id(0)

    @pl.when(pid < token_programs)
    def _scatter():  # read a token tile once, write its K copies to their rows
        toks = (pid // d_tiles) * bt + jnp.arange(bt)
        cols = (pid % d_tiles) * bd + jnp.arange(bd)
        tok_ok, col_ok = toks < num_tokens, cols < dim
        x = plgpu.load(
            x_ref.at[toks[:, None] * dim + cols[None, :]], mask=tok_ok[:, None] & col_ok[None, :], other=0
        )
        x = x.astype(jnp.float32)
        for k in range(top_k):  # K is small and static: unrolled
            dest = plgpu.load(dest_ref.at[toks * top_k + k], mask=tok_ok, other=-1)
            scale = plgpu.load(scale_ref.at[toks * top_k + k], mask=tok_ok, other=0.0)
            ok = (dest >= 0) & (dest < num_rows)
            row = jnp.where(ok, dest, 0)
            addr = row[:, None] * dim + cols[None, :]
            val = (x * scale[:, None]).astype(out_ref.dtype)
            _store(out_ref, addr, val, ok[:, None] & col_ok[None, :], interpret)

    @pl.when(pid >= token_programs)
    def _zero_fill():  # rows no copy lands on
        q = pid - token_programs
        rows = (q // d_tiles) * br + jnp.arange(br)
        cols = (q % d_tiles) * bd + jnp.arange(bd)
        row_ok, col_ok = rows < num_rows, cols < dim
        empty = plgpu.load(filled_ref.at[rows], mask=row_ok, other=1) == 0
        addr = rows[:, None] * dim + cols[None, :]
        _store(
            out_ref,
            addr,
            jnp.zeros((br, bd), out_ref.dtype),
            (empty & row_ok)[:, None] & col_ok[None, :],
            interpret,
        )


def scatter_rows_pallas(
    x_TD, dest_TK, scale_TK, num_rows: int, *, block_tokens=16, block_rows=16, block_d=1024, num_warps=None,
    interpret=False,
):  # fmt: skip
    """out[dest[t,k]] = x[t] * scale[t,k]; rows nobody fills are zeros. Valid dests must be distinct."""
    (num_tokens, dim), top_k = x_TD.shape, dest_TK.shape[1]
    dest_A = dest_TK.reshape(-1)
    ok_A = (dest_A >= 0) & (dest_A < num_rows)
    filled_R = jnp.zeros((num_rows,), jnp.int32).at[jnp.where(ok_A, dest_A, num_rows)].set(1, mode="drop")
    bt, br, bd = block_tokens, block_rows, _block_d(dim, block_d)
    d_tiles = pl.cdiv(dim, bd)
    token_programs = pl.cdiv(num_tokens, bt) * d_tiles
    kernel = functools.partial(
        _scatter_rows_kernel, num_tokens=num_tokens, num_rows=num_rows, dim=dim, top_k=top_k, bt=bt, br=br, bd=bd,
        token_programs=token_programs, interpret=interpret,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows * dim,), x_TD.dtype),
        grid=(token_programs + pl.cdiv(num_rows, br) * d_tiles,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        name="xmoe_scatter_rows",
    )(dest_A, scale_TK.astype(jnp.float32).reshape(-1), filled_R, x_TD.reshape(-1))
    return out.reshape(num_rows, dim)


def _combine_kernel(dest_ref, w_ref, y_ref, out_ref, *, num_tokens, num_rows, dim, top_k, bt, bd, interpret):
    d_tiles = pl.cdiv(dim, bd)
    pid = pl.program_id(0)
    toks = (pid // d_tiles) * bt + jnp.arange(bt)
    cols = (pid % d_tiles) * bd + jnp.arange(bd)
    tok_ok, col_ok = toks < num_tokens, cols < dim
    acc = jnp.zeros((bt, bd), jnp.float32)
    for k in range(top_k):  # K is small and static: unrolled
        dest = plgpu.load(dest_ref.at[toks * top_k + k], mask=tok_ok, other=-1)
        w = plgpu.load(w_ref.at[toks * top_k + k], mask=tok_ok, other=0.0)
        ok = (dest >= 0) & (dest < num_rows)
        row = jnp.where(ok, dest, 0)
        y = plgpu.load(
            y_ref.at[row[:, None] * dim + cols[None, :]], mask=ok[:, None] & col_ok[None, :], other=0
        )
        acc += y.astype(jnp.float32) * jnp.where(ok, w, 0.0)[:, None]
    addr = toks[:, None] * dim + cols[None, :]
    _store(out_ref, addr, acc.astype(out_ref.dtype), tok_ok[:, None] & col_ok[None, :], interpret)


def combine_rows_pallas(
    y_RD, dest_TK, weights_TK, *, block_tokens=16, block_d=1024, num_warps=None, interpret=False
):
    """out[t] = sum_k w[t,k] * y[dest[t,k]] over valid destinations; weights float (or None: ones)."""
    (num_rows, dim), (num_tokens, top_k) = y_RD.shape, dest_TK.shape
    if weights_TK is None:
        weights_TK = jnp.ones(dest_TK.shape, jnp.float32)
    bt, bd = block_tokens, _block_d(dim, block_d)
    kernel = functools.partial(
        _combine_kernel, num_tokens=num_tokens, num_rows=num_rows, dim=dim, top_k=top_k, bt=bt, bd=bd,
        interpret=interpret,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens * dim,), y_RD.dtype),
        grid=(pl.cdiv(num_tokens, bt) * pl.cdiv(dim, bd),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        name="xmoe_combine",
    )(dest_TK.reshape(-1), weights_TK.astype(jnp.float32).reshape(-1), y_RD.reshape(-1))
    return out.reshape(num_tokens, dim)


def _gather_dot_kernel(
    dest_ref, a_ref, b_ref, out_ref, *, num_tokens, num_rows, dim, top_k, bt, bd, interpret
):
    toks = pl.program_id(0) * bt + jnp.arange(bt)
    tok_ok = toks < num_tokens
    dests, oks = [], []
    for k in range(top_k):
        dest = plgpu.load(dest_ref.at[toks * top_k + k], mask=tok_ok, other=-1)
        ok = (dest >= 0) & (dest < num_rows)
        dests.append(jnp.where(ok, dest, 0))
        oks.append(ok)

    def body(i, accs):
        cols = i * bd + jnp.arange(bd)
        col_ok = cols < dim
        a_mask = tok_ok[:, None] & col_ok[None, :]
        a = plgpu.load(a_ref.at[toks[:, None] * dim + cols[None, :]], mask=a_mask, other=0).astype(
            jnp.float32
        )
        new = []
        for k in range(top_k):
            b_mask = oks[k][:, None] & col_ok[None, :]
            b = plgpu.load(b_ref.at[dests[k][:, None] * dim + cols[None, :]], mask=b_mask, other=0)
            new.append(accs[k] + jnp.sum(a * b.astype(jnp.float32), axis=1))
        return tuple(new)

    zeros = tuple(jnp.zeros((bt,), jnp.float32) for _ in range(top_k))
    accs = lax.fori_loop(0, pl.cdiv(dim, bd), body, zeros)
    for k in range(top_k):
        _store(out_ref, toks * top_k + k, accs[k], tok_ok, interpret)


def gather_dot_pallas(a_TD, b_RD, dest_TK, *, block_tokens=16, block_d=256, num_warps=None, interpret=False):
    """out[t,k] = a[t] . b[dest[t,k]] in float32 (0 for dropped copies)."""
    (num_rows, dim), (num_tokens, top_k) = b_RD.shape, dest_TK.shape
    bt, bd = block_tokens, _block_d(dim, block_d)
    kernel = functools.partial(
        _gather_dot_kernel, num_tokens=num_tokens, num_rows=num_rows, dim=dim, top_k=top_k, bt=bt, bd=bd,
        interpret=interpret,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens * top_k,), jnp.float32),
        grid=(pl.cdiv(num_tokens, bt),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        name="xmoe_gather_dot",
    )(dest_TK.reshape(-1), a_TD.reshape(-1), b_RD.reshape(-1))
    return out.reshape(num_tokens, top_k)
