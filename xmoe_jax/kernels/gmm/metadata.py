"""Megablox-style work lists for grouped GEMMs: which row tile and which group each program takes.

Legend: R rows (lhs rows, grouped contiguously by expert), E experts (groups), I work items.

The rows of group e are [start_e, end_e) with start_e = sum(group_sizes[:e]). A row tile of
`block_m` rows may straddle group boundaries, so one tile can belong to several groups. A work
item is one (row tile, group) pair with a non-empty overlap; a kernel program computes that
tile's product with that group's weights and stores only the rows inside the group (masking
the others). There are at most `cdiv(R, block_m) + E - 1` items, a static bound, so the grid
is static while the assignment is computed on the device from `group_sizes` (no host sync).

Rows past sum(group_sizes) belong to no item: no kernel reads, computes or stores them (the
index list is padded, never the tensor). Items past the real count point at group E, an empty
pseudo-group, and do nothing. Kernels that must zero the rows nobody writes run fill programs
for them (schedule.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupMetadata(NamedTuple):
    item_group_I: jax.Array  # int32 group of each work item (E = idle)
    item_tile_I: jax.Array  # int32 row tile of each work item
    group_start_G: jax.Array  # int32 [E+1] first row of each group (incl. the idle one)
    group_end_G: jax.Array  # int32 [E+1] one past the last row


def group_bounds(group_sizes_E: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """[start, end) of each group, clipped to the buffer (sizes summing past R are cut)."""
    ends_E = jnp.minimum(jnp.cumsum(group_sizes_E.astype(jnp.int32)), num_rows)
    starts_E = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_E[:-1]])
    return starts_E, ends_E


def num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound on work items: each of the E-1 group boundaries adds at most one tile."""
    return max(-(-num_rows // block_m) + num_groups - 1, 1)


def make_group_metadata(group_sizes_E: jax.Array, num_rows: int, block_m: int) -> GroupMetadata:
    num_groups = group_sizes_E.shape[0]
    starts_E, ends_E = group_bounds(group_sizes_E, num_rows)
    # group E: empty, for idle items
    start_G = jnp.concatenate([starts_E, jnp.zeros((1,), jnp.int32)]).astype(jnp.int32)
    end_G = jnp.concatenate([ends_E, jnp.zeros((1,), jnp.int32)]).astype(jnp.int32)

    size_G = end_G - start_G
    first_tile_G = start_G // block_m
    last_tile_G = (end_G - 1) // block_m
    tiles_G = jnp.where(size_G > 0, last_tile_G - first_tile_G + 1, 0)
    item_end_G = jnp.cumsum(tiles_G)
    item_start_G = item_end_G - tiles_G

    num_items = num_work_items(num_rows, num_groups, block_m)
    item_I = jnp.arange(num_items, dtype=jnp.int32)
    # group of item i = number of groups whose items all come before i
    group_I = jnp.sum(item_I[:, None] >= item_end_G[None, :], axis=1).astype(jnp.int32)
    group_I = jnp.minimum(group_I, num_groups)
    tile_I = first_tile_G[group_I] + item_I - item_start_G[group_I]
    tile_I = jnp.where(group_I < num_groups, tile_I, 0).astype(jnp.int32)
    return GroupMetadata(group_I, tile_I, start_G, end_G)
