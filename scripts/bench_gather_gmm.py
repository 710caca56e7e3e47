"""Row-indexed grouped GEMMs against today's permute + gmm + ungroup, next to a dense ceiling.

    python scripts/bench_gather_gmm.py --out gather_gmm.json          # on one GPU (~1 min on an H100)
    python scripts/bench_gather_gmm.py --tiny --out /tmp/g.json        # CPU, tiny shapes (the test's)

The X-MoE Small expert shapes (bf16, D 2048, F 1408) with about 98k routed rows, two cases
(perf/gather_bench.py):
  ep1  64 experts, 16384 tokens x top-6 on one device: the up-projection reads permute(x_TD)
       (a) or gathers token rows through `token_rows` (b); the layer's d x sums each token's
       K rows with `combine` in both.
  ep4  16 local experts x 4 sources, 98304 received rows in arrival order (source, local
       expert): (a) groups them with a permute before the up-projection and ungroups the
       down-projection's output with a combine; (b) gathers on load and scatters on store.
Each projection is timed forward and forward+backward (d lhs, d w), with a dense bf16 matmul of
the same FLOPs (3x for forward+backward) as the ceiling, and torch's `_grouped_mm` on the
already-grouped rows as the peer when torch with CUDA is importable. Before timing, each (b)
result is checked against the XLA reference (gather + ragged_dot + scatter) and against (a):
relative errors go in the table and the JSON. Results go to --out after every measurement.
"""

from __future__ import annotations

import argparse

from xmoe_jax.perf.gather_bench import main

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes that run on a CPU in seconds")
    p.add_argument("--cases", default="ep1,ep4")
    p.add_argument("--backend", default=None, help="kernel backend (default: the platform's, pallas on GPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-torch", action="store_true", help="skip torch._grouped_mm even if importable")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    main(p.parse_args())
