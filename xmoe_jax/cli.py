"""Command-line entry points: `xmoe-train` and `xmoe-params`.

    xmoe-train --config configs/tiny.yaml [--set model.moe.top_k=4 ...] [--resume]
    xmoe-train ... --coordinator HOST:PORT --num-processes N --process-id I   # multi-process
    xmoe-params --config configs/small.yaml

Errors in the input (config, data, run directory, checkpoint) print one line naming
the problem and the fix, and exit with status 2 before anything is compiled.
"""

from __future__ import annotations

import argparse
import logging
import sys

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


def _fail(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 2


def train_main(argv: list[str] | None = None) -> int:
    p = _parser("xmoe-train", "Train a DeepSeek-style MoE transformer.")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in train.run_dir from its latest checkpoint"
    )
    distributed.add_cli_flags(p)
    args = p.parse_args(argv)
    from xmoe_jax.xla_flags import apply_defaults

    apply_defaults()  # before anything starts JAX's backend
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("xmoe_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    from xmoe_jax.train.checkpoint import CheckpointError
    from xmoe_jax.train.loop import TrainingError, train

    try:
        cfg = load_config(args.config, args.overrides)
        launch = distributed.initialize_from_args(args)  # before any other JAX use
        distributed.quiet_unless_main(launch)
        result = train(cfg, resume=args.resume)
    except (ConfigError, CheckpointError, TrainingError) as err:
        return _fail(err)
    last = result.records[-1] if result.records else {}
    if launch.process_id == 0:
        print(
            f"done: step {result.final_step}, loss {last.get('loss', float('nan')):.4f}, "
            f"run dir {cfg.train.run_dir}"
        )
    return 0


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
