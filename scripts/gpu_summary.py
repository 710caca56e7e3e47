"""The short table the scripts/gpu_bench_*.sh drivers print last: one line per JSON under a folder
(train steps from bench_train_step.py, plans from xmoe-plan --out).

    python3 scripts/gpu_summary.py "$OUT"
    python3 scripts/gpu_summary.py "$OUT" --ladder   # weak scaling: ladder_<mode>_<n>gpu.json files
    python3 scripts/gpu_summary.py "$OUT" --history  # per run, its metrics.jsonl (<run>/metrics.jsonl)
"""

import glob
import json
import os
import re
import sys

GiB = 2**30


def line(name: str, r: dict) -> str | None:
    if "tokens_per_s" in r:
        return (
            f"{name:<40} tok/s {r['tokens_per_s']:>10.0f}  TFLOP/s {r['tflops_per_device']:6.1f}  "
            f"MFU {100 * (r['mfu_vs_datasheet'] or 0):5.1f}%  first step {r['first_step_s'] or 0:6.1f}s  "
            f"peak {(r['peak_bytes_in_use'] or 0) / GiB:6.1f} GiB  "
            f"loss {r['first_loss']:.3f}->{r['final_loss']:.3f}  {_exchange(r.get('exchange', {}))}"
            f"{'  ' + str(r['overlap']) if 'overlap' in r else ''}"
            f"{'  router ' + r['router'] if r.get('router') else ''}"
        )
    if "peak" in r:
        return (
            f"{name:<40} plan peak {r['peak'] / GiB:6.2f} GiB  temp {r['temporaries'] / GiB:6.2f} GiB  "
            f"fits {r.get('fits')}  compile {r['compile_s']:6.1f}s"
        )
    return None


def _exchange(ex: dict) -> str:
    """The exchange in a few words: buffer factor, fullest buffer, wire over routed bytes, bound ratio."""
    if not ex.get("routed_bytes"):
        return ""
    wire = sum(ex["wire_bytes"]) / max(sum(ex["routed_bytes"]), 1)
    bound = ex.get("exchange_bound_ratio") or [float("nan")]
    return (
        f"factor {ex.get('buffer_factor')} peak {ex.get('peak_ratio')} wire/routed {wire:.2f} "
        f"bound R {sum(bound) / len(bound):.2f}"
    )


def ladder(folder: str) -> None:
    """Weak scaling: tokens/s per GPU of each mode and GPU count, and its ratio to the same mode on 1 GPU
    (the issue's goal: >= 0.85 at every step)."""
    rows = {}
    for path in glob.glob(os.path.join(folder, "ladder_*_*gpu.json")):
        m = re.match(r"ladder_(.+)_(\d+)gpu\.json$", os.path.basename(path))
        with open(path) as f:
            rows[(m.group(1), int(m.group(2)))] = json.load(f)
    print(
        f"{'mode':<8} {'GPUs':>4} {'tok/s per GPU':>14} {'vs 1 GPU':>8} {'MFU':>6} {'first step':>10} {'peak GiB':>8}"
    )
    for mode, n in sorted(rows):
        r, one = rows[(mode, n)], rows.get((mode, 1))
        per_gpu = r["tokens_per_s"] / r["num_devices"]
        ratio = per_gpu / (one["tokens_per_s"] / one["num_devices"]) if one else float("nan")
        print(
            f"{mode:<8} {n:>4} {per_gpu:>14,.0f} {ratio:>8.2f} {100 * (r['mfu_vs_datasheet'] or 0):>5.1f}% "
            f"{r['first_step_s'] or 0:>9.1f}s {(r['peak_bytes_in_use'] or 0) / GiB:>8.1f}"
        )


def history(folder: str) -> None:
    """Each run directory's logged steps (metrics.jsonl, every log window): loss, throughput, and the
    exchange's buffer factor, fullest buffer, wire over routed bytes, bound ratio and expert imbalance."""
    for path in sorted(glob.glob(os.path.join(folder, "*", "metrics.jsonl"))):
        print(f"## {path}\n")
        print("| step | loss | tokens/s | MFU | factor | peak | wire/routed | bound R | imbalance |")
        print("|---|---|---|---|---|---|---|---|---|")
        with open(path) as f:
            records = [json.loads(text) for text in f]
        for r in records:
            if "loss" not in r or "wire_bytes" not in r:
                continue
            wire = sum(r["wire_bytes"]) / max(sum(r["routed_bytes"]), 1)
            bound = sum(r["exchange_bound_ratio"]) / len(r["exchange_bound_ratio"])
            print(
                f"| {r['step']} | {r['loss']:.4f} | {r.get('tokens_per_s') or 0:,.0f} | "
                f"{100 * (r.get('mfu') or 0):.1f}% | {r['buffer_factor']} | {r['peak_ratio']} | {wire:.2f} | "
                f"{bound:.2f} | {max(r['expert_imbalance']):.2f} |"
            )


def main(folder: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            text = line(os.path.basename(path), json.load(f))
        if text:
            print(text)


if __name__ == "__main__":
    if "--ladder" in sys.argv[2:]:
        ladder(sys.argv[1])
    elif "--history" in sys.argv[2:]:
        history(sys.argv[1])
    else:
        main(sys.argv[1])
