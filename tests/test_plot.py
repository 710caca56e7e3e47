"""`xmoe-plot` without training: the expert-load heat map labels every expert up to 16, then every
k-th (issue 22: the tiny model's 8 experts were labelled 0 and 5 only); a picture that cannot be
written (a full disk) is one line, status 1, and no partial file (issue 37 3.3)."""

from __future__ import annotations

import json
import subprocess
import sys

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


def _metrics(run_dir) -> None:
    load = np.random.default_rng(0).uniform(0.5, 1.5, (2, 8)).tolist()
    records = [{"step": s, "loss": 5.0 - s / 100, "expert_load": load} for s in (10, 20, 30)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_expert_load_png_from_metrics(tmp_path):
    pytest.importorskip("matplotlib", reason="xmoe-plot needs the viz extra")
    _metrics(tmp_path)
    written = plot_run(tmp_path)
    assert [p.name for p in written] == ["loss.png", "expert_load.png"]
    assert all(p.stat().st_size > 0 for p in written)


# xmoe-plot under a file-size limit of 4 kB (a full disk, a quota: the same errors); matplotlib is
# imported first so that its font cache is not what fails
LIMITED = """
import resource, sys
import matplotlib.pyplot
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from xmoe_jax.cli import plot_main
sys.exit(plot_main(sys.argv[1:]))
"""


def test_a_picture_that_cannot_be_written_is_one_line_and_no_partial_file(tmp_path):
    """Issue 37 3.3: a full disk printed a 33-line traceback from inside PIL."""
    pytest.importorskip("matplotlib", reason="xmoe-plot needs the viz extra")
    _metrics(tmp_path)
    before = plot_run(tmp_path)[0].read_bytes()  # an earlier picture stays whole
    for out in (tmp_path / "plots", tmp_path / "new" / "plots"):
        argv = ["--run-dir", str(tmp_path), "--out", str(out)]
        done = subprocess.run(
            [sys.executable, "-c", LIMITED, *argv], capture_output=True, text=True, timeout=120
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert lines[0] == (
            f"error: {out / 'loss.png'} could not be written (File too large); free space, raise the quota "
            "or the file-size limit (ulimit -f), or name another folder (--out)"
        )
    assert (tmp_path / "plots" / "loss.png").read_bytes() == before
    assert not (tmp_path / "new" / "plots" / "loss.png").exists()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["expert_load.png", "loss.png"]
