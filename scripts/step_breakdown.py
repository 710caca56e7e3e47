"""Where a train step's time goes on each GPU, from a jax.profiler trace of a few steps.

    python3 scripts/step_breakdown.py RUN_DIR/profile --steps N [--out report.json] [--plot breakdown.png]
    python3 scripts/step_breakdown.py RUN_DIR/profile --steps N --hlo DUMP/module_...jit_step...after_optimizations.txt

Reads every *.xplane.pb under the folder (`train.profile_steps=[a, b]` writes them; N = b - a + 1)
and prints a Markdown table per GPU and the mean: attention, expert GEMMs, other GEMMs, recompute,
optimizer, micro-batch loop, other compute, exchange (exposed; hidden beside it) and idle, in ms
per step. xmoe_jax/perf/step_breakdown.py says how kernels are sorted; docs/profiling.md how to
take and read a trace. Exit status 2 on a missing trace, a trace without GPU planes (a CPU run)
or an unknown step count, with one line on stderr. `--hlo` (the step's optimized HLO text, .gz or not,
from XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text") names the kernels the trace names by their
program only (multi-output fusions, else counted as the optimizer) by their instruction's op_name.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

from xmoe_jax.errors import XmoeError
from xmoe_jax.perf.hlo import op_names
from xmoe_jax.perf.step_breakdown import breakdown
from xmoe_jax.perf.step_report import format_table, plot
from xmoe_jax.perf.trace_kernels import TraceError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a folder holding the trace (any depth), e.g. RUN_DIR/profile")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps the trace covers (default: from the trace's step events)",
    )
    p.add_argument(
        "--module", default=None, help="regex of the step's program (default: the busiest, jit_step)"
    )
    p.add_argument(
        "--hlo",
        default=None,
        help="the step's optimized HLO text (.gz too): names kernels the trace does not",
    )
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    p.add_argument("--plot", default=None, help="also draw a stacked bar per GPU and the mean (PNG)")
    args = p.parse_args(argv)
    try:
        names = None
        if args.hlo and not os.path.isfile(args.hlo):
            raise TraceError(
                f"--hlo {args.hlo}: no such file (the step's *after_optimizations.txt from --xla_dump_to)"
            )
        if args.hlo:
            with (gzip.open if args.hlo.endswith(".gz") else open)(args.hlo, "rt") as f:
                names = op_names(f.read())
        rep = breakdown(args.folder, steps=args.steps, module=args.module, hlo_names=names)
        if args.plot:
            plot(rep, args.plot)
    except XmoeError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(format_table(rep))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
