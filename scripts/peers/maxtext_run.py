"""Run MaxText's own pre-training loop (maxtext.trainers.pre_train.train) on the peer shape and write
tokens/s and peak device memory as JSON.

    PYTHONPATH=scripts/peers/stubs:$PYTHONPATH python scripts/peers/maxtext_run.py \
        --config configs/tiny_small_shape.yaml --policy full --steps 30 --out maxtext_full.json

Needs MaxText 0.2.5 and its imports (scripts/peers_wheels.sh), with the stubs of pathwaysutils and
xprof (scripts/peers/stubs) on PYTHONPATH; DECOUPLE_GCLOUD=TRUE keeps the Google Cloud clients out.
Throughput: the mean step time of the last third of the steps (as scripts/bench_train_step.py takes
its last logging window), from MaxText's per-step metrics file. Memory: the device's
peak_bytes_in_use after the run. --set key=value adds or replaces MaxText keys (the CPU smoke test
uses it for tiny dimensions).

Expert parallel: --ep N sets `ici_expert_parallelism=N`, MaxText's expert mesh axis, in this one
process over all its devices (ici_fsdp_parallelism stays -1: the devices left over, 1 when N is
the device count). The batch is per device (`per_device_batch_size`), so the global batch grows
with the devices; the routed experts are split N ways and the sparse-matmul path exchanges the
routed tokens with an all-to-all. CPU check: XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_shape import load_shape, maxtext_overrides  # noqa: E402

# MaxText's best dropless GPU path (issue 25): tokamax's grouped matmul, cuDNN flash attention.
GPU_PATH = ["sparse_matmul=true", "use_tokamax_gmm=true", "attention=cudnn_flash_jax", "hardware=gpu"]


def merged(*lists: list[str]) -> list[str]:
    """key=value lists, later keys replacing earlier ones, first-seen order kept."""
    out: dict[str, str] = {}
    for items in lists:
        for item in items:
            key, sep, _ = item.partition("=")
            if not sep:
                raise SystemExit(f"--set {item!r}: expected key=value (a MaxText base.yml key)")
            out[key] = item
    return list(out.values())


def window_stats(metrics_path: Path, steps: int) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "perf/step_time_seconds" in r]
    if not rows:
        raise SystemExit(f"{metrics_path}: MaxText wrote no step metrics; see its log above")
    window = max(steps // 3, 1)
    last = rows[-window:]
    step_s = sum(r["perf/step_time_seconds"] for r in last) / len(last)
    return {
        "window_steps": len(last),
        "step_s": step_s,
        "first_loss": rows[0].get("learning/loss"),
        "final_loss": last[-1].get("learning/loss"),
        "first_step_s": rows[0]["perf/step_time_seconds"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default="configs/tiny_small_shape.yaml", help="the xmoe_jax config whose shape to run"
    )
    p.add_argument("--policy", default="full", help="MaxText remat_policy (none and full both recompute all)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=None, help="per-device batch (default: the config's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="MaxText key=value")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test: ragged_dot and dot_product attention")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree: ici_expert_parallelism")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    shape = load_shape(args.config)
    import jax
    import maxtext
    from absl import app
    from maxtext.trainers.pre_train import train

    base_yml = Path(maxtext.__file__).parent / "configs" / "base.yml"
    path = (
        ["hardware=cpu", "use_tokamax_gmm=false", "megablox=false", "attention=dot_product"]
        if args.cpu
        else GPU_PATH
    )
    with tempfile.TemporaryDirectory() as tmp:
        metrics_path = Path(tmp) / "metrics.jsonl"
        keys = merged(
            maxtext_overrides(shape, args.batch_size),
            path,
            [
                f"run_name=peers_{args.policy}",
                f"base_output_directory={tmp}/out",
                "skip_jax_distributed_system=true",
                f"remat_policy={args.policy}",
                f"steps={args.steps}",
                f"log_period={args.steps}",
                f"metrics_file={metrics_path}",
                "enable_tensorboard=false",
                "enable_goodput_recording=false",
                "monitor_goodput=false",
                f"ici_expert_parallelism={args.ep}",
            ],
            args.overrides,
        )
        t0 = time.perf_counter()
        try:
            app.run(train.main, argv=["maxtext_train", str(base_yml), *keys])
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        wall_s = time.perf_counter() - t0
        stats = window_stats(metrics_path, args.steps)
    memory = jax.local_devices()[0].memory_stats() or {}
    final = dict(k.split("=", 1) for k in keys)
    batch = int(float(final["per_device_batch_size"]))
    tokens = batch * int(final["max_target_length"]) * jax.device_count()
    dev = jax.devices()[0]
    out = {
        "system": "maxtext",
        "version": maxtext.__version__ if hasattr(maxtext, "__version__") else _dist_version("maxtext"),
        "policy": args.policy,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev.device_kind,
        "num_devices": jax.device_count(),
        "ep": int(final["ici_expert_parallelism"]),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "config": args.config,
        "keys": keys,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "batch_size": batch,
        "tokens_per_step": tokens,
        "steps": args.steps,
        **stats,
        "tokens_per_s": tokens / stats["step_s"],
        "wall_s": wall_s,
        "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
