"""moe/stats.py's table: every statistic says how it combines, and both mergers follow it.

Plain arrays, nothing compiles. The overlap chunks of one shard (moe/dispatchers.py) and the
micro-batches of one step (train/step.py) must agree: counts add up, peaks are the max, rates
and losses are means over micro-batches. `max_nodes_per_token` is a maximum in both.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xmoe_jax.moe.stats import FIELDS, PER_DEVICE, ExchangeStats, MoEStats, merge_chunks, merge_micro


def test_every_field_has_one_row():
    assert list(FIELDS) == list(MoEStats._fields)
    routing = [f for f in MoEStats._fields if f not in ExchangeStats._fields]
    assert all(FIELDS[f].chunks is None and not FIELDS[f].per_device for f in routing)
    assert all(FIELDS[f].chunks in ("sum", "max") for f in ExchangeStats._fields)
    assert set(PER_DEVICE) < set(ExchangeStats._fields)


def _exchange(scale: int) -> ExchangeStats:
    return ExchangeStats(*(jnp.asarray([1.0, 2.0]) * scale for _ in ExchangeStats._fields))


def test_chunks_and_micro_batches_merge_alike():
    """Two parts, [1, 2] and [3, 6] per device: a sum gives [4, 8], a max [3, 6]."""
    chunks = merge_chunks([_exchange(1), _exchange(3)])
    stacked = MoEStats(*(jnp.stack([jnp.asarray([1.0, 2.0]) * s for s in (1, 3)]) for _ in MoEStats._fields))
    micro = merge_micro(stacked)
    expected = {"sum": [4.0, 8.0], "max": [3.0, 6.0], "mean": [2.0, 4.0]}
    for name in MoEStats._fields:
        np.testing.assert_array_equal(getattr(micro, name), expected[FIELDS[name].micro], err_msg=name)
        if name in ExchangeStats._fields:
            assert FIELDS[name].chunks == FIELDS[name].micro, name
            np.testing.assert_array_equal(getattr(chunks, name), expected[FIELDS[name].chunks], err_msg=name)
    np.testing.assert_array_equal(micro.max_nodes_per_token, [3.0, 6.0])  # was summed over micro-batches


def test_fields_a_dispatch_leaves_out_stay_none():
    part = _exchange(1)._replace(pilot_rows=None, max_nodes_per_token=None)
    merged = merge_chunks([part, part])
    assert merged.pilot_rows is None and merged.max_nodes_per_token is None
