"""Whether NCCL kernels ran concurrently with GEMM kernels in a jax.profiler trace (per GPU).

    python3 scripts/kernel_overlap.py RUN_DIR/profile [--out report.json]

Reads every *.xplane.pb under the folder (xmoe_jax/perf/kernel_overlap.py says how kernels are
sorted and overlap is measured) and prints one line per GPU; exit status 2 if there is no trace.
"""

from __future__ import annotations

import argparse
import json
import sys

from xmoe_jax.perf.kernel_overlap import format_report, report_folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a folder holding the trace (any depth), e.g. RUN_DIR/profile")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    args = p.parse_args()
    try:
        rep = report_folder(args.folder)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(rep))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
