"""The tile schedule of the Triton-style grouped GEMM kernels, written once: what a program owns
and which rows its loads and stores go through. The bf16 kernel (pallas.py) and the FP8 kernel
(pallas_fp8.py) are two bodies of this schedule, differing only in their loads and dots.

Legend: R grouped rows (the GEMM's rows, grouped contiguously by expert), L rows of lhs, O rows of
the output, K contraction, N output columns, E experts, I work items (metadata.py); bm/bk/bn the
tile. S = sum(group_sizes) (clipped to R): the grouped rows that exist.

Grid: I * cdiv(N, bn) GEMM programs, N tiles fastest, then (with `fill`) cdiv(O, bm) * cdiv(N, bn)
fill programs. GEMM program (i, j) takes work item i (a row tile and one group overlapping it,
metadata.py) and the j-th column tile:
  1. rows = the tile's grouped rows, row_ok = the rows inside the item's group (so r < S);
  2. with a gather index, src = lhs_rows[rows] (loaded under row_ok; an index outside [0, L)
     reads zeros), else src = rows, read as one contiguous block;
  3. the body's K loop accumulates in float32 (idle items, group E, run no K step);
  4. with a scatter index, dst = out_rows[rows] (outside [0, O): not stored), else dst = rows;
     rows with row_ok false are never stored.
Fill program (p, j): output rows p*bm.. that no GEMM program writes (`written_O` is 0) get zeros,
in column tile j. GEMM and fill programs write disjoint rows, so one launch does both.

Gathered and scattered rows are addressed by index arrays on both dimensions (`ref.at[rows[:, None],
cols[None, :]]`): that lowers through Pallas's Triton backend to one masked pointer load or store,
vLLM's `offs_token // top_k` pattern, and runs in interpret mode (which cannot mix an index array
with a slice). In interpret mode masked lanes write their old value back, so masked scattered lanes
aim at row O, past the end, where writes are dropped; on a GPU they touch no memory.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xmoe_jax.kernels.gmm.metadata import make_group_metadata


class Rows(NamedTuple):
    """The static row facts of one kernel call (which index arrays it passes)."""

    gather: bool  # lhs rows through lhs_rows_R
    scatter: bool  # output rows through out_rows_R
    fill: bool  # zero the output rows nobody writes (written_O passed)
    num_lhs_rows: int  # L
    num_out_rows: int  # O


class Tile(NamedTuple):
    """What one GEMM program owns (all traced values; `src`/`dst` None: contiguous rows)."""

    group: jax.Array  # the work item's group (E: an idle item)
    w_group: jax.Array  # group clamped to a real expert, for addressing the weights
    num_k: jax.Array  # K steps to run: 0 for idle items
    row0: jax.Array  # first grouped row of the tile
    row_ok: jax.Array  # [bm] grouped rows inside the item's group
    src: jax.Array | None  # [bm] lhs rows to load (gathered), or None: rows row0..row0+bm
    src_ok: jax.Array  # [bm] rows to load
    dst: jax.Array | None  # [bm] output rows to store (scattered), or None: rows row0..
    dst_ok: jax.Array  # [bm] rows to store
    col0: jax.Array  # first output column
    cols: jax.Array  # [bn] output columns
    col_ok: jax.Array  # [bn] columns inside N


def index_args(rows: Rows, lhs_rows_R, out_rows_R, written_O) -> tuple:
    """The index arrays a kernel call passes after the metadata, in the order `split_refs` takes them."""
    return tuple(
        a for a, on in ((lhs_rows_R, rows.gather), (out_rows_R, rows.scatter), (written_O, rows.fill)) if on
    )


def split_refs(refs, rows: Rows):
    """(metadata refs, lhs_rows, out_rows, written, the kernel's other refs) from a kernel's refs."""
    meta, rest = refs[:4], list(refs[4:])
    lhs_rows = rest.pop(0) if rows.gather else None
    out_rows = rest.pop(0) if rows.scatter else None
    written = rest.pop(0) if rows.fill else None
    return meta, lhs_rows, out_rows, written, rest


def num_programs(num_items: int, rows: Rows, n_dim: int, bm: int, bn: int) -> int:
    n_tiles = pl.cdiv(n_dim, bn)
    return num_items * n_tiles + (pl.cdiv(rows.num_out_rows, bm) * n_tiles if rows.fill else 0)


def _load_index(ref, row0, bm, row_ok, limit):
    idx = plgpu.load(ref.at[pl.ds(row0, bm)], mask=row_ok, other=-1)
    ok = row_ok & (idx >= 0) & (idx < limit)
    return idx, ok


def make_tile(meta_refs, lhs_rows_ref, out_rows_ref, item, col_tile, *, rows: Rows, num_groups, n_dim, bm, bk, k_dim, bn, interpret) -> Tile:  # fmt: skip
    """Steps 1, 2 and 4 of the module docstring for work item `item` and column tile `col_tile`."""
    item_group_ref, item_tile_ref, group_start_ref, group_end_ref = meta_refs
    group = item_group_ref[item]
    row0 = pl.multiple_of(item_tile_ref[item] * bm, bm)
    grouped = row0 + jnp.arange(bm)
    row_ok = (grouped >= group_start_ref[group]) & (grouped < group_end_ref[group])
    src, src_ok = None, row_ok
    if rows.gather:
        src, src_ok = _load_index(lhs_rows_ref, row0, bm, row_ok, rows.num_lhs_rows)
        src = jnp.where(src_ok, src, 0)
    dst, dst_ok = None, row_ok
    if rows.scatter:
        dst, dst_ok = _load_index(out_rows_ref, row0, bm, row_ok, rows.num_out_rows)
        dst = jnp.where(dst_ok, dst, rows.num_out_rows if interpret else 0)
    col0 = pl.multiple_of(col_tile * bn, bn)
    cols = col0 + jnp.arange(bn)
    num_k = (group < num_groups).astype(jnp.int32) * pl.cdiv(k_dim, bk)
    return Tile(
        group=group, w_group=jnp.minimum(group, num_groups - 1), num_k=num_k, row0=row0, row_ok=row_ok,
        src=src, src_ok=src_ok, dst=dst, dst_ok=dst_ok, col0=col0, cols=cols, col_ok=cols < n_dim,
    )  # fmt: skip


def load_rows(ref, tile: Tile, c0, width: int, bm: int, *, limit: int | None = None, other=0):
    """[bm, width] of a row-major ref at the tile's lhs rows, columns c0.. (masked past `limit`).

    `other=None` leaves masked lanes undefined (fp8: Triton cannot fill an fp8 tensor)."""
    cols = c0 + jnp.arange(width)
    mask = tile.src_ok[:, None]
    if limit is not None:
        mask = mask & (cols < limit)[None, :]
    if tile.src is None:
        view = ref.at[pl.ds(tile.row0, bm), pl.ds(c0, width)]
    else:
        view = ref.at[tile.src[:, None], cols[None, :]]
    return plgpu.load(view, mask=mask, other=other)


def store_rows(out_ref, tile: Tile, val, bm: int, bn: int) -> None:
    """Store [bm, bn] at the tile's output rows and columns (step 4)."""
    mask = tile.dst_ok[:, None] & tile.col_ok[None, :]
    if tile.dst is None:
        view = out_ref.at[pl.ds(tile.row0, bm), pl.ds(tile.col0, bn)]
    else:
        view = out_ref.at[tile.dst[:, None], tile.cols[None, :]]
    plgpu.store(view, val.astype(out_ref.dtype), mask=mask)


def fill_program(written_ref, out_ref, q, *, rows: Rows, n_dim, bm, bn) -> None:
    """Fill program q: zeros into the rows of its tile that no GEMM program writes."""
    n_tiles = pl.cdiv(n_dim, bn)
    row0 = pl.multiple_of((q // n_tiles) * bm, bm)
    col0 = pl.multiple_of((q % n_tiles) * bn, bn)
    out_rows = row0 + jnp.arange(bm)
    row_ok = out_rows < rows.num_out_rows
    empty = plgpu.load(written_ref.at[pl.ds(row0, bm)], mask=row_ok, other=1) == 0
    col_ok = (col0 + jnp.arange(bn)) < n_dim
    plgpu.store(
        out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)],
        jnp.zeros((bm, bn), out_ref.dtype),
        mask=(empty & row_ok)[:, None] & col_ok[None, :],
    )


def run_gmm(refs, body, *, rows: Rows, num_groups, k_dim, n_dim, bm, bk, bn, interpret, store=None) -> None:
    """One program of the grid: a GEMM program runs `body(tile, operand_refs) -> [bm, bn] float32`
    and stores it (`store_rows`, or `store(out_ref, tile, acc, operand_refs)`: an epilogue); a fill
    program zeros unwritten rows. `refs` are the kernel's refs as passed."""
    meta, lhs_rows_ref, out_rows_ref, written_ref, rest = split_refs(refs, rows)
    *operand_refs, out_ref = rest
    n_tiles = pl.cdiv(n_dim, bn)
    gemm_programs = meta[0].shape[0] * n_tiles
    pid = pl.program_id(0)

    def gemm():
        tile = make_tile(
            meta, lhs_rows_ref, out_rows_ref, pid // n_tiles, pid % n_tiles, rows=rows, num_groups=num_groups,
            n_dim=n_dim, bm=bm, bk=bk, k_dim=k_dim, bn=bn, interpret=interpret,
        )  # fmt: skip
        acc = body(tile, operand_refs)
        if store is None:
            store_rows(out_ref, tile, acc, bm, bn)
        else:
            store(out_ref, tile, acc, operand_refs)

    if not rows.fill:
        gemm()
        return
    pl.when(pid < gemm_programs)(gemm)
    pl.when(pid >= gemm_programs)(
        lambda: fill_program(written_ref, out_ref, pid - gemm_programs, rows=rows, n_dim=n_dim, bm=bm, bn=bn)
    )


def written_rows(group_sizes_E, num_rows: int, out_rows_R, num_out_rows: int) -> jax.Array:
    """int32 [O]: 1 for the output rows some grouped row r < S writes (the fill programs' input)."""
    total = jnp.minimum(jnp.sum(group_sizes_E.astype(jnp.int32)), num_rows)
    if out_rows_R is None:
        return (jnp.arange(num_out_rows, dtype=jnp.int32) < total).astype(jnp.int32)
    live_R = jnp.arange(num_rows, dtype=jnp.int32) < total
    dst_R = jnp.where(live_R & (out_rows_R >= 0) & (out_rows_R < num_out_rows), out_rows_R, num_out_rows)
    return jnp.zeros((num_out_rows,), jnp.int32).at[dst_R].set(1, mode="drop")


def plan(group_sizes_E, num_lhs_rows: int, bm: int, lhs_rows_R=None, out_rows_R=None, num_out_rows=None, zero_unwritten=False):  # fmt: skip
    """(Rows, the schedule's leading kernel inputs: work list and index arrays) for one gmm call."""
    num_rows = num_lhs_rows if lhs_rows_R is None else lhs_rows_R.shape[0]
    num_out = num_rows if out_rows_R is None else int(num_out_rows)
    rows = Rows(lhs_rows_R is not None, out_rows_R is not None, bool(zero_unwritten), num_lhs_rows, num_out)
    meta = make_group_metadata(group_sizes_E, num_rows, bm)
    written_O = written_rows(group_sizes_E, num_rows, out_rows_R, num_out) if rows.fill else None
    return rows, (*meta, *index_args(rows, lhs_rows_R, out_rows_R, written_O))
