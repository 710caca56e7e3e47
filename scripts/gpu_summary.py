"""The short table the scripts/gpu_bench_*.sh drivers print last: one line per JSON under a folder
(train steps from bench_train_step.py, plans from xmoe-plan --out).

    python3 scripts/gpu_summary.py "$OUT"
"""

import glob
import json
import os
import sys

GiB = 2**30


def line(name: str, r: dict) -> str | None:
    if "tokens_per_s" in r:
        return (
            f"{name:<40} tok/s {r['tokens_per_s']:>10.0f}  TFLOP/s {r['tflops_per_device']:6.1f}  "
            f"MFU {100 * (r['mfu_vs_datasheet'] or 0):5.1f}%  first step {r['first_step_s'] or 0:6.1f}s  "
            f"peak {(r['peak_bytes_in_use'] or 0) / GiB:6.1f} GiB  "
            f"loss {r['first_loss']:.3f}->{r['final_loss']:.3f}  {r.get('exchange', {})}"
        )
    if "peak" in r:
        return (
            f"{name:<40} plan peak {r['peak'] / GiB:6.2f} GiB  temp {r['temporaries'] / GiB:6.2f} GiB  "
            f"fits {r.get('fits')}  compile {r['compile_s']:6.1f}s"
        )
    return None


def main(folder: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            text = line(os.path.basename(path), json.load(f))
        if text:
            print(text)


if __name__ == "__main__":
    main(sys.argv[1])
