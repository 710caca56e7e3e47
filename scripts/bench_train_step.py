"""Train-step throughput of a config on the local devices, with a same-run matmul ceiling.

    python scripts/bench_train_step.py --config configs/tiny_small_shape.yaml \
        --set model.moe.capacity_factor=1.25 --steps 30 --out results.json

Runs the real trainer (xmoe_jax.train.loop.train) for --steps steps, takes the
throughput of the last logging window (compilation excluded), and prints model
TFLOP/s per device, MFU against the datasheet peak, and the ratio against a dense
bf16 matmul measured on the same device in the same run. The JSON holds every step's loss.

Several processes of one job (one per GPU, as a cluster runs it) take `xmoe-train`'s launch flags;
`python -m xmoe_jax.launch.local` starts them on one host (scripts/gpu_bench_procs.sh):

    python -m xmoe_jax.launch.local -n 4 --one-device-each -- \
        python scripts/bench_train_step.py --config ... --out procs4.json

Process 0 writes the JSON; every process leaves through the peer watch and
`xmoe_jax.launch.distributed.shutdown()`, as `xmoe-train` does.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import traceback

from xmoe_jax.config import load_config  # plain Python: no JAX yet
from xmoe_jax.launch import xla_flags


def _summary(record: dict) -> dict:
    """One logged step in a line: throughput, loss, routing and the exchange's buffers and bytes."""
    out = {k: record.get(k) for k in ("step", "loss", "tokens_per_s", "mfu", "buffer_factor", "peak_ratio")}
    if record.get("expert_imbalance"):
        out["max_imbalance"] = max(record["expert_imbalance"])
    if record.get("routed_bytes"):
        out["wire_over_routed"] = sum(record["wire_bytes"]) / max(sum(record["routed_bytes"]), 1)
        out["bound_ratio_mean"] = sum(record["exchange_bound_ratio"]) / len(record["exchange_bound_ratio"])
    return out


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The user's --set overrides, then what this script decides: its --steps, the logging window, no
    checkpoints. Every load of the config takes them, so the load-time checks read the steps that
    run (train.profile_steps past the YAML's train.steps but inside --steps is fine)."""
    window = args.log_every or max(args.steps // 3, 1)
    return [
        *args.overrides,
        f"train.steps={args.steps}",
        f"train.log_every={window}",
        "checkpoint.enabled=false",
    ]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("xmoe_jax").setLevel(logging.INFO)  # buffer changes, compile time
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument(
        "--run-dir", default=None, help="keep the run directory here (a profile trace: train.profile_steps)"
    )
    p.add_argument(
        "--matmul-size", type=int, default=8192, help="n of the n^3 bf16 matmul ceiling (CPU checks: small)"
    )
    p.add_argument(
        "--log-every", type=int, default=None, help="logging window (default: a third of the steps)"
    )
    from xmoe_jax.cli import add_cli_flags, initialize_from_args  # no backend starts on import

    add_cli_flags(p)
    args = p.parse_args()
    # before JAX starts its backend: the config's scheduler (else XMOE_XLA_SCHEDULER) and the ragged
    # preset its transport needs (`exact`: XLA's one-shot kernel, no decomposer)
    parallel = load_config(args.config, run_overrides(args)).parallel
    sched = parallel.xla_scheduler
    xla_flags.apply_defaults(scheduler=None if sched == "default" else sched, transport=parallel.transport)
    from xmoe_jax.launch import distributed, peers

    launch = initialize_from_args(args)  # several processes: before anything touches a device
    distributed.quiet_unless_main(launch)
    watch = peers.watch(launch)
    try:
        out = measure(args)
    except Exception as err:
        if not launch.is_multi_process:
            raise
        traceback.print_exc()
        watch.fail(f"{type(err).__name__}: {err}")  # tells the others, exits 1
    watch.leave(0)
    distributed.shutdown()  # every process together; a no-op for one
    if launch.process_id == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


def measure(args: argparse.Namespace) -> dict:
    """The run and its result record (plain Python values only: no arrays outlive it)."""
    import jax

    from xmoe_jax.perf.timing import dense_matmul_tflops, environment
    from xmoe_jax.train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [*run_overrides(args), f"train.run_dir={args.run_dir or tmp}"])
        result = train(cfg)
    last = result.records[-1]
    memory = jax.local_devices()[0].memory_stats() or {}
    ceiling = dense_matmul_tflops(args.matmul_size)
    out = {
        **environment(),
        "config": args.config,
        "overrides": args.overrides,
        "dispatch": cfg.parallel.dispatch if cfg.model.moe else None,
        "capacity_factor": cfg.model.moe.capacity_factor if cfg.model.moe else None,
        # label every number: the vendors' tables force-balance (model.moe.force_balance), ours default to learned
        "router": ("force-balanced" if cfg.model.moe.force_balance else "learned") if cfg.model.moe else None,
        "overlap": {
            "overlap": cfg.parallel.overlap,
            "chunks": cfg.parallel.overlap_chunks,
            "xla_scheduler": xla_flags.effective_scheduler(),
        },
        "num_processes": jax.process_count(),
        "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len,
        "steps": args.steps,
        "window_steps": cfg.train.log_every,
        "tokens_per_s": last["tokens_per_s"],
        "tflops_per_device": last["tflops_per_device"],
        "mfu_vs_datasheet": last["mfu"],
        "dense_matmul_tflops": ceiling,
        "ratio_vs_dense_matmul": last["tflops_per_device"] / ceiling,
        "first_loss": result.records[0]["loss"],
        "losses": [result.losses[s] for s in sorted(result.losses)],  # every step: exactness checks
        "final_loss": last["loss"],
        "drop_rate": last.get("drop_rate"),
        "first_step_s": result.first_step_s,  # compilation + the first step
        "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
        "exchange": {
            k: last[k]
            for k in (
                "wire_bytes",
                "routed_bytes",
                "peak_ratio",
                "buffer_factor",
                "buffer_changes",
                "exchange_rows",
                "exchange_bound_ratio",
            )
            if k in last
        },  # fmt: skip
        "transport": cfg.parallel.transport,
        "history": [_summary(r) for r in result.records if "loss" in r],
    }
    return out


if __name__ == "__main__":
    main()
