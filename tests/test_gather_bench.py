"""scripts/bench_gather_gmm.py runs end to end on tiny shapes (CPU, the platform's backend): every
variant is checked against the XLA reference before it is timed, and the JSON holds each row."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_bench_gather_gmm_runs_tiny(tmp_path):
    out = tmp_path / "gather.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "scripts/bench_gather_gmm.py",
        "--tiny",
        "--iters",
        "1",
        "--no-torch",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "relative errors" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert not [r for r in results if "error" in r], results
    checks = [r for r in results if "check" in r]
    assert len(checks) == 3 * 3  # ep1 up, ep4 up and down: each variant vs XLA, and (b) vs (a)
    assert all(r["rel_err"] < 1e-2 for r in checks), checks
    timed = {(r["case"], r["proj"], r["variant"], r["pass_"]) for r in results if "ms" in r}
    for case, proj, variant in [
        ("ep1", "up", "b_gather"),
        ("ep4", "up", "b_gather"),
        ("ep4", "down", "b_scatter"),
    ]:
        for pass_ in ("fwd", "fwd+bwd"):
            assert (case, proj, variant, pass_) in timed
            assert (case, proj, "dense_same_flops", pass_) in timed
