"""scripts/bench_loss.py runs end to end on tiny shapes (CPU): each loss variant is checked against the
float32 loss before it is timed, beside the same-run baseline of its GEMMs alone, and the JSON holds
every row."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_bench_loss_runs_tiny(tmp_path):
    out = tmp_path / "loss.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "scripts/bench_loss.py", "--tiny", "--iters", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| gemms_only |" in proc.stdout
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"gemms_only", "online", "two_pass"}
    assert all(rows[v]["rel_err"] < 2e-2 for v in ("online", "two_pass")), rows  # bf16 against float32
    assert abs(rows["online"]["loss"] - rows["two_pass"]["loss"]) < 1e-4 * rows["two_pass"]["loss"]
