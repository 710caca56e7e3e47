"""Command-line entry points: `xmoe-train` and `xmoe-params`.

    xmoe-train --config configs/tiny.yaml [--set model.moe.top_k=4 ...] [--resume]
    xmoe-train ... --coordinator HOST:PORT --num-processes N --process-id I   # multi-process
    xmoe-params --config configs/small.yaml

Exit status of `xmoe-train` (docs/reliability.md):
    0   the run finished;
    1   it failed: a non-finite loss under train.nan_policy=stop, another process of the job
        died or failed (`xmoe_jax.peers`), or an unexpected error;
    2   bad input, before anything compiled: config, data, run directory (a file, read-only,
        or in use by another trainer), an incompatible checkpoint or none that restores intact;
    75  stopped by a signal of train.stop_signals after saving a checkpoint (EX_TEMPFAIL):
        run the same command with --resume (the SLURM scripts requeue the job).
Errors print one line naming the problem and the fix.

The launch flags (`add_cli_flags`) and the call that turns them into a started job
(`initialize_from_args`) live here too; `scripts/launch_plan.py` shares them. How flags,
XMOE_* variables and SLURM combine is `xmoe_jax.distributed`'s rule.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from xmoe_jax import distributed
from xmoe_jax.config import ConfigError, load_config

DEFAULT_CONFIG_HELP = "YAML config (default: the built-in tiny defaults)"


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", default=None, help=DEFAULT_CONFIG_HELP)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set train.steps=50 (repeatable)",
    )
    return p


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """The launch flags of `xmoe-train` (all optional; SLURM is detected without them)."""
    g = parser.add_argument_group("multi-process (default: detect SLURM srun steps, else one process)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env XMOE_COORDINATOR)")
    g.add_argument("--num-processes", type=int, metavar="N", help="total processes (env XMOE_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env XMOE_PROCESS_ID)")
    g.add_argument(
        "--local-device-ids", metavar="0,1", help="devices this process uses (env XMOE_LOCAL_DEVICE_IDS)"
    )
    g.add_argument(
        "--init-timeout",
        type=int,
        metavar="S",
        help="seconds to wait for all processes "
        f"(env XMOE_INIT_TIMEOUT, default {distributed.DEFAULT_TIMEOUT_S})",
    )
    g.add_argument(
        "--peer-timeout",
        type=int,
        metavar="S",
        help="seconds after which a silent process counts as dead and the others stop "
        f"(env XMOE_PEER_TIMEOUT, default {distributed.DEFAULT_PEER_TIMEOUT_S})",
    )
    g.add_argument(
        "--no-distributed",
        action="store_true",
        help="one process: ignore SLURM and XMOE_* launch variables (env XMOE_DISTRIBUTED=0)",
    )


def initialize_from_args(args: argparse.Namespace) -> distributed.LaunchPlan:
    """`distributed.initialize()` from the flags of `add_cli_flags`; `--no-distributed` forces one process."""
    off = args.no_distributed or os.environ.get("XMOE_DISTRIBUTED", "1").lower() in ("0", "false", "no")
    if off and (args.coordinator or args.num_processes or args.process_id is not None):
        raise distributed.DistributedError(
            "--no-distributed conflicts with --coordinator/--num-processes/--process-id"
        )
    return distributed.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        args.local_device_ids,
        args.init_timeout,
        auto=not off,
        peer_timeout_s=getattr(args, "peer_timeout", None),
    )


EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def _fail(err: Exception, code: int = EXIT_BAD_INPUT) -> int:
    print(f"error: {err}", file=sys.stderr)
    return code


def train_main(argv: list[str] | None = None) -> int:
    p = _parser("xmoe-train", "Train a DeepSeek-style MoE transformer.")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in train.run_dir from its latest checkpoint"
    )
    add_cli_flags(p)
    args = p.parse_args(argv)
    from xmoe_jax.xla_flags import apply_defaults

    apply_defaults()  # before anything starts JAX's backend
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("xmoe_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    from xmoe_jax import peers
    from xmoe_jax.train import preemption
    from xmoe_jax.train.checkpoint import CheckpointError
    from xmoe_jax.train.loop import TrainingError, train
    from xmoe_jax.train.preemption import PREEMPTED_EXIT_CODE, Preempted

    try:
        cfg = load_config(args.config, args.overrides)
        launch = initialize_from_args(args)  # before any other JAX use
    except ConfigError as err:  # DistributedError included
        return _fail(err)
    distributed.quiet_unless_main(launch)
    watch = peers.watch(launch)  # several processes: stop when another dies
    result, message = None, ""
    try:
        result = train(cfg, resume=args.resume)
        code = 0
    except Preempted:  # the loop logged where it saved
        code = PREEMPTED_EXIT_CODE
        preemption.ignore(cfg.train.stop_signals)
    except (ConfigError, CheckpointError) as err:
        code, message = _fail(err), str(err)
    except TrainingError as err:
        code, message = _fail(err, EXIT_FAILED), str(err)
    except Exception as err:
        if not launch.is_multi_process:
            raise  # the traceback, status 1
        traceback.print_exc()
        watch.fail(f"{type(err).__name__}: {err}")  # tells the others, names silent peers, exits 1
    watch.leave(code, message)  # every process ends here together: leave in order
    distributed.shutdown()
    if result is not None and launch.process_id == 0:
        last = result.records[-1] if result.records else {}
        print(
            f"done: step {result.final_step}, loss {last.get('loss', float('nan')):.4f}, "
            f"run dir {cfg.train.run_dir}"
        )
    return code


def params_main(argv: list[str] | None = None) -> int:
    p = _parser("xmoe-params", "Print the parameter counts of a model config.")
    args = p.parse_args(argv)
    from xmoe_jax.params import format_param_table

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return _fail(err)
    print(format_param_table(cfg.model))
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
