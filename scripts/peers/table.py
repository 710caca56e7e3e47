"""The peer tables: one row per JSON under a folder (xmoe_jax from scripts/bench_train_step.py,
MaxText from maxtext_run.py, torchtitan from titan_run.py), MFU by one formula for all, and each row's
ratio to xmoe_jax. One table for the one-GPU rows; one for the rows on several GPUs (expert
parallel), whose ratios are to xmoe_jax's expert-parallel row on as many GPUs in the same folder.

    python3 scripts/peers/table.py "$OUT" [--config configs/tiny_small_shape.yaml] [--json peers.json]

(from the repo root: it imports xmoe_jax for the FLOPs formula)

MFU = tokens/s per GPU x xmoe_jax.train.metrics.flops_per_token(the xmoe config) / the device's
datasheet bf16 peak, for every system: the peers' gated experts of equal FLOPs (+0.9% of the step) are counted
as ours. Peak memory: JAX's peak_bytes_in_use; torch's max_memory_allocated (and reserved, the
figure comparable to JAX's allocator pool, in brackets), of one GPU (rank 0 / the first local
device). Ratios, one GPU: tokens/s and peak memory over xmoe_jax's `none` and `full` rows of the same
folder (torch: reserved); several GPUs: tokens/s per GPU and peak memory over xmoe_jax's fastest
row on as many GPUs. Batch: sequences per GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

GiB = 2**30


def row_of(name: str, r: dict) -> dict | None:
    """A table row from one result file, or None for files that are not runs."""
    if "tokens_per_s" not in r:
        return None
    system = r.get("system")
    if system is None:  # scripts/bench_train_step.py
        remat = [o.split("=", 1)[1] for o in r.get("overrides", []) if o.startswith("model.remat=")]
        system, policy, peak, reserved = (
            "xmoe_jax",
            (remat[-1] if remat else "none"),
            r.get("peak_bytes_in_use"),
            None,
        )
        batch = None  # tokens_per_step / the config's seq_len / GPUs, in add_mfu
        gpus = r.get("num_devices") or 1
        ep = [int(o.split("=", 1)[1]) for o in r.get("overrides", []) if o.startswith("mesh.expert=")]
        ep = ep[-1] if ep else 1
    elif system == "torchtitan":
        policy, peak, reserved, batch = (
            r["policy"],
            r.get("max_memory_allocated"),
            r.get("max_memory_reserved"),
            r["batch_size"],
        )
        gpus, ep = r.get("num_gpus") or 1, r.get("ep") or 1
    else:
        policy, peak, reserved, batch = r["policy"], r.get("peak_bytes_in_use"), None, r["batch_size"]
        gpus, ep = r.get("num_devices") or 1, r.get("ep") or 1
    return {
        "file": name,
        "system": system,
        "policy": policy,
        "batch": batch,
        "gpus": gpus,
        "ep": ep,
        "tokens_per_s": r["tokens_per_s"],
        "tokens_per_s_per_gpu": r["tokens_per_s"] / gpus,
        "tokens_per_step": r.get("tokens_per_step"),
        "peak_gib": peak / GiB if peak else None,
        "reserved_gib": reserved / GiB if reserved else None,
        "device": r.get("device"),
    }


def add_mfu(rows: list[dict], config: str) -> float:
    sys.path.insert(0, os.getcwd())  # the repo root: xmoe_jax
    from xmoe_jax.config import load_config
    from xmoe_jax.train.metrics import flops_per_token, peak_tflops

    cfg = load_config(config, [])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    for row in rows:
        if row["batch"] is None and row["tokens_per_step"]:
            row["batch"] = row["tokens_per_step"] // cfg.train.seq_len // row["gpus"]
        peak = peak_tflops(row["device"] or "")
        row["mfu"] = row["tokens_per_s_per_gpu"] * fpt / 1e12 / peak if peak else None
    return fpt


def add_ratios(rows: list[dict]) -> None:
    ref = {r["policy"]: r for r in rows if r["system"] == "xmoe_jax" and r["gpus"] == 1}
    many = {}  # GPUs -> xmoe_jax's fastest row on that many
    for r in rows:
        if r["system"] == "xmoe_jax" and r["gpus"] > 1:
            best = many.get(r["gpus"])
            if best is None or r["tokens_per_s_per_gpu"] > best["tokens_per_s_per_gpu"]:
                many[r["gpus"]] = r
    for row in rows:
        mem = row["reserved_gib"] or row["peak_gib"]
        if row["gpus"] > 1:
            base = many.get(row["gpus"])
            row["xmoe_ep_file"] = base["file"] if base else None
            row["speed_vs_ep"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
            row["mem_vs_ep"] = mem / base["peak_gib"] if base and mem and base["peak_gib"] else None
            continue
        for policy in ("none", "full"):
            base = ref.get(policy)
            row[f"speed_vs_{policy}"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
            row[f"mem_vs_{policy}"] = mem / base["peak_gib"] if base and mem and base["peak_gib"] else None


def fmt(value, spec: str, unit: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{unit}"


def memory(r: dict) -> str:
    mem = fmt(r["peak_gib"], ".1f")
    return mem + (f" ({r['reserved_gib']:.1f} reserved)" if r["reserved_gib"] else "")


def markdown_ep(rows: list[dict]) -> str:
    """The rows on several GPUs: per GPU, over xmoe_jax's expert-parallel row on as many."""
    lines = [
        "| system | recomputation | GPUs | EP | batch per GPU | tokens/s per GPU | MFU | peak memory (GiB) | "
        "tok/s ÷ xmoe EP | memory ÷ xmoe EP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['policy']} | {r['gpus']} | {r['ep']} | {fmt(r['batch'], 'd')} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {fmt(r['mfu'] and 100 * r['mfu'], '.1f', '%')} | {memory(r)} | "
            f"{fmt(r['speed_vs_ep'], '.2f')} | {fmt(r['mem_vs_ep'], '.2f')} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    head = (
        "| system | recomputation | batch | tokens/s | MFU | peak memory (GiB) | "
        "tok/s ÷ xmoe none | tok/s ÷ xmoe full | memory ÷ xmoe none | memory ÷ xmoe full |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['policy']} | {fmt(r['batch'], 'd')} | {r['tokens_per_s']:,.0f} | "
            f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f', '%')} | {memory(r)} | {fmt(r['speed_vs_none'], '.2f')} | "
            f"{fmt(r['speed_vs_full'], '.2f')} | {fmt(r['mem_vs_none'], '.2f')} | {fmt(r['mem_vs_full'], '.2f')} |"
        )
    return "\n".join(lines)


ORDER = {"xmoe_jax": 0, "maxtext": 1, "torchtitan": 2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument(
        "--config", default="configs/tiny_small_shape.yaml", help="relative to the repo root (cwd)"
    )
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    rows, raw = [], {}
    for path in sorted(glob.glob(os.path.join(args.folder, "*.json"))):
        if args.json and os.path.abspath(path) == os.path.abspath(args.json):
            continue
        with open(path) as f:
            result = json.load(f)
        row = row_of(os.path.basename(path), result)
        if row:
            rows.append(row)
            raw[os.path.basename(path)] = result
    if not rows:
        raise SystemExit(f"{args.folder}: no result JSON (tokens_per_s) found; see the step logs there")
    rows.sort(key=lambda r: (r["gpus"], ORDER.get(r["system"], 9), -r["tokens_per_s"]))
    fpt = add_mfu(rows, args.config)
    add_ratios(rows)
    print(f"model FLOPs per token (xmoe_jax formula, {args.config}): {fpt / 1e9:.4f} GFLOP")
    one = [r for r in rows if r["gpus"] == 1]
    if one:
        print(markdown(one))
    for gpus in sorted({r["gpus"] for r in rows} - {1}):
        print(f"\nExpert parallel on {gpus} GPUs (per GPU; ratios to xmoe_jax's row on {gpus} GPUs):")
        print(markdown_ep([r for r in rows if r["gpus"] == gpus]))
    if args.json:
        Path(args.json).write_text(json.dumps({"flops_per_token": fpt, "rows": rows, "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
