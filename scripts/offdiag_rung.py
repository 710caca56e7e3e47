"""The rung a run's receive buffers need when sized by all expert-rank pairs against the off-diagonal
pairs alone (rows a GPU keeps never travel), from the `exchange_rows` a run logs in metrics.jsonl.

    python scripts/offdiag_rung.py benchmarks/results/depth_4xh200_small28L_bucketed_100steps.metrics.jsonl

Per logged step: the fullest pair over the mean pair (largest over the layers), both ways, and the
share of layers whose fullest pair is a diagonal one. Results: benchmarks/depth.md.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(path: str) -> None:
    print("| step | all pairs | off-diagonal only | layers with a diagonal fullest |\n|---|---:|---:|---:|")
    for line in open(path):
        record = json.loads(line)
        if "exchange_rows" not in record:
            continue
        rows_LPP = np.asarray(record["exchange_rows"], float)  # summed over the step's micro-batches
        num_peers = rows_LPP.shape[1]
        mean_L = rows_LPP.sum((1, 2)) / num_peers**2
        off_LPP = np.where(np.eye(num_peers, dtype=bool), -1.0, rows_LPP)
        diag_LP = np.einsum("lii->li", rows_LPP)
        print(
            f"| {record['step']} | {(rows_LPP.max((1, 2)) / mean_L).max():.3f} "
            f"| {(off_LPP.max((1, 2)) / mean_L).max():.3f} "
            f"| {(diag_LP.max(1) >= off_LPP.max((1, 2))).mean():.0%} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
