"""`xmoe-plot` without training: the expert-load heat map labels every expert up to 16, then every
k-th (issue 22: the tiny model's 8 experts were labelled 0 and 5 only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xmoe_jax.plot import expert_ticks, plot_run


@pytest.mark.parametrize(
    "num_experts, ticks",
    [
        (1, [0]),
        (8, list(range(8))),
        (16, list(range(16))),
        (17, list(range(0, 17, 2))),
        (64, list(range(0, 64, 4))),
        (256, list(range(0, 256, 16))),
    ],
)
def test_expert_ticks_all_up_to_16_then_every_kth(num_experts, ticks):
    assert expert_ticks(num_experts) == ticks


def test_expert_load_png_from_metrics(tmp_path):
    pytest.importorskip("matplotlib", reason="xmoe-plot needs the viz extra")
    load = np.random.default_rng(0).uniform(0.5, 1.5, (2, 8)).tolist()
    records = [{"step": s, "loss": 5.0 - s / 100, "expert_load": load} for s in (10, 20, 30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_run(tmp_path)
    assert [p.name for p in written] == ["loss.png", "expert_load.png"]
    assert all(p.stat().st_size > 0 for p in written)
