"""Command-line entry points: `xmoe-train`, `xmoe-params`, `xmoe-plan`, `xmoe-generate`, `xmoe-convert`.

    xmoe-train --config configs/tiny.yaml [--set model.moe.top_k=4 ...] [--resume]
    xmoe-train ... --coordinator HOST:PORT --num-processes N --process-id I   # multi-process
    xmoe-params --config configs/small.yaml
    xmoe-generate --run-dir runs/tiny --prompt "To be" [--max-tokens 64 --temperature 0.8 ...]
    xmoe-convert import --hf-dir DIR --out RUN_DIR / export --run-dir RUN_DIR --out DIR

Errors in the input (config, data, run directory, checkpoint) print one line naming
the problem and the fix, and exit with status 2 before anything is compiled.

The launch flags (`add_cli_flags`) and the call that turns them into a started job
(`initialize_from_args`) live here too; `scripts/launch_plan.py` shares them. How flags,
XMOE_* variables and SLURM combine is `xmoe_jax.distributed`'s rule.
"""

from __future__ import annotations

import argparse
import logging
import os
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
    )


def _fail(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 2


def train_main(argv: list[str] | None = None) -> int:
    p = _parser("xmoe-train", "Train a DeepSeek-style MoE transformer.")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in train.run_dir from its latest checkpoint"
    )
    add_cli_flags(p)
    args = p.parse_args(argv)
    from xmoe_jax.xla_flags import apply_defaults

    apply_defaults()  # before anything starts JAX's backend
    _quiet_logging()
    logging.getLogger("xmoe_jax").setLevel(logging.INFO)
    from xmoe_jax.train.checkpoint import CheckpointError
    from xmoe_jax.train.loop import TrainingError, train

    try:
        cfg = load_config(args.config, args.overrides)
        launch = initialize_from_args(args)  # before any other JAX use
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


def plan_main(argv: list[str] | None = None) -> int:
    p = _parser(
        "xmoe-plan", "Per-device memory of a config's train step on N devices (ahead-of-time compile)."
    )
    p.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 64GiB or 80GB")
    p.add_argument(
        "--real-devices", action="store_true", help="compile for this host's accelerators (count must match)"
    )
    p.add_argument("--out", default=None, help="also write the plan as JSON here")
    args = p.parse_args(argv)
    if args.devices < 1:
        return _fail(ConfigError(f"--devices={args.devices} must be >= 1"))
    if not args.real_devices:  # before JAX starts: N fake CPU devices, Pallas kernels (see xmoe_jax/plan.py)
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("XMOE_KERNELS", "pallas")
    from xmoe_jax.xla_flags import apply_defaults

    apply_defaults()
    import jax

    from xmoe_jax.plan import parse_bytes, plan

    try:
        cfg = load_config(args.config, args.overrides)
        memory = parse_bytes(args.device_memory) if args.device_memory else None
        if jax.device_count() != args.devices:
            raise ConfigError(
                f"--devices={args.devices} but JAX has {jax.device_count()} devices "
                f"({'set by XLA_FLAGS already' if not args.real_devices else 'this host'}); "
                "plan for the devices there are, or run in a fresh process"
            )
        result = plan(cfg, memory)
    except (ConfigError, ValueError) as err:
        return _fail(err)
    print(result.table())
    if args.out:
        import json

        with open(args.out, "w") as f:
            json.dump(result.as_dict(), f, indent=1)
    return 0


def _quiet_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)


def generate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="xmoe-generate", description="Sample text from a run's checkpoint.")
    p.add_argument("--run-dir", required=True, help="a run directory (train.run_dir) with checkpoints")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt, byte-level (repeatable)")
    p.add_argument(
        "--prompt-ids", action="append", default=[], help='a prompt as token ids, "1 2 3" (repeatable)'
    )
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the most likely tokens holding p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-id", type=int, default=None, help="stop a row at this token id")
    p.add_argument(
        "--mesh", action="store_true", help="run on the run's mesh and placement (default: one device)"
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from xmoe_jax.xla_flags import apply_defaults

    apply_defaults()
    _quiet_logging()
    from xmoe_jax.generate import SamplingConfig, generate_from_run
    from xmoe_jax.generate.text import decode, encode
    from xmoe_jax.train.checkpoint import CheckpointError

    try:
        prompts = [encode(t) for t in args.prompt] + [[int(i) for i in s.split()] for s in args.prompt_ids]
        if not prompts:
            raise ConfigError("give at least one --prompt TEXT or --prompt-ids '1 2 3'")
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        outs = generate_from_run(
            args.run_dir, prompts, args.max_tokens, sampling, args.seed, step=args.step, on_mesh=args.mesh,
            overrides=args.overrides, eos_id=args.eos_id,
        )  # fmt: skip
    except (ConfigError, CheckpointError, ValueError) as err:
        return _fail(err)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        print(f"=== {i + 1}/{len(prompts)}")
        is_text = i < len(args.prompt)
        print(decode(prompt + out) if is_text else " ".join(map(str, prompt + out)))
    return 0


def convert_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="xmoe-convert", description="HuggingFace checkpoints in and out.")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a HuggingFace directory -> a run directory to train or resume")
    imp.add_argument(
        "--hf-dir", required=True, help="safetensors + config.json (Mixtral, Qwen2/3-MoE, OLMoE)"
    )
    imp.add_argument("--out", required=True, help="the new run directory (config.yaml, checkpoints/0)")
    exp = sub.add_parser("export", help="a run's checkpoint -> safetensors + config.json for transformers")
    exp.add_argument("--run-dir", required=True)
    exp.add_argument("--out", required=True, help="the output directory")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    exp.add_argument("--arch", default=None, help="model_type to write (default: the first that fits)")
    exp.add_argument("--dtype", default="float32", help="float32 (exact) or bfloat16")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    for q in (imp, exp):
        q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from xmoe_jax.xla_flags import apply_defaults

    apply_defaults()
    _quiet_logging()
    from xmoe_jax.hf.convert import ConversionError, export_checkpoint, import_checkpoint
    from xmoe_jax.plan import parse_bytes
    from xmoe_jax.train.checkpoint import CheckpointError

    try:
        if args.command == "import":
            cfg = import_checkpoint(args.hf_dir, args.out, args.overrides)
            print(f"imported {args.hf_dir} into {cfg.train.run_dir}; continue training with:")
            print(f"  xmoe-train --config {cfg.train.run_dir}/config.yaml --resume")
        else:
            files = export_checkpoint(
                args.run_dir, args.out, args.step, args.arch, args.dtype, args.overrides,
                parse_bytes(args.max_shard_size),
            )  # fmt: skip
            print(f"exported {args.run_dir} to {args.out}: config.json, {', '.join(files)}")
    except (ConversionError, ConfigError, CheckpointError, ValueError) as err:
        return _fail(err)
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
