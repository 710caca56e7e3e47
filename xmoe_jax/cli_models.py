"""Command-line entry points that read or write a model: `xmoe-generate` (sample from a run's
checkpoint) and `xmoe-convert` (HuggingFace checkpoints in and out).

    xmoe-generate --run-dir runs/tiny --prompt "To be" [--max-tokens 64 --temperature 0.8 ...]
    xmoe-convert import --hf-dir DIR --out RUN_DIR / export --run-dir RUN_DIR --out DIR

Exit status and error handling as `xmoe_jax.cli` (its `command` decorator): 0 done, 2 bad input
(one line naming the problem and the fix), 1 anything unexpected.
"""

from __future__ import annotations

import argparse

from xmoe_jax.cli import command, progress, quiet_logging, value_errors_are_bad_input
from xmoe_jax.config import ConfigError


def _token_ids(text: str) -> list[int]:
    """`--prompt-ids "1 2 3"` as a list of ints; `ConfigError` naming the flag and the fix."""
    words = text.replace(",", " ").split()
    bad = [w for w in words if not w.isdigit()]
    if bad or not words:
        what = f"{bad[0]!r} is not a token id" if bad else "it holds no token ids"
        raise ConfigError(
            f"--prompt-ids {text!r}: {what}; give non-negative integers separated by spaces, e.g. "
            "--prompt-ids '1 2 3' (use --prompt for text)"
        )
    return [int(w) for w in words]


@command
def generate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="xmoe-generate", description="Sample text from a run's checkpoint.")
    p.add_argument("--run-dir", required=True, help="a run directory (train.run_dir) with checkpoints")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a text prompt, encoded with the run's tokenizer (repeatable)",
    )
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
    from xmoe_jax.generate.sampling import SamplingConfig

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)  # before anything loads
    if not args.prompt and not args.prompt_ids:
        raise ConfigError("give at least one --prompt TEXT or --prompt-ids '1 2 3'")
    ids = [_token_ids(s) for s in args.prompt_ids]
    from xmoe_jax.launch.xla_flags import apply_defaults

    apply_defaults()
    quiet_logging()
    from xmoe_jax.data import load_tokenizer, provenance
    from xmoe_jax.generate import generate_from_run
    from xmoe_jax.train.rundir import RunDir

    with value_errors_are_bad_input():
        run = RunDir(args.run_dir)
        cfg = run.input_config(args.step, args.overrides)  # the config of the step it generates with
        tokenizer = load_tokenizer(provenance.for_tools(run.tokenizer, cfg, args.overrides).data.tokenizer)
        prompts = tokenizer.encode_batch(args.prompt) + ids
        outs = generate_from_run(
            args.run_dir, prompts, args.max_tokens, sampling, args.seed, step=args.step, on_mesh=args.mesh,
            overrides=args.overrides, eos_id=args.eos_id, report=progress,
        )  # fmt: skip
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        print(f"=== {i + 1}/{len(prompts)}")
        is_text = i < len(args.prompt)
        print(tokenizer.decode(prompt + out) if is_text else " ".join(map(str, prompt + out)))
    return 0


@command
def convert_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="xmoe-convert", description="HuggingFace checkpoints in and out.")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a HuggingFace directory -> a run directory to train or resume")
    imp.add_argument(
        "--hf-dir",
        required=True,
        help="safetensors + config.json (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3)",
    )
    imp.add_argument("--out", required=True, help="the new run directory (config.yaml, checkpoints/0)")
    imp.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="import weights that hold NaN or infinite values (refused by default, naming the tensor)",
    )
    exp = sub.add_parser("export", help="a run's checkpoint -> safetensors + config.json for transformers")
    exp.add_argument("--run-dir", required=True)
    exp.add_argument(
        "--out",
        required=True,
        help="the output folder: new, empty, holding only a tokenizer, or an earlier export (--overwrite)",
    )
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    exp.add_argument("--arch", default=None, help="model_type to write (default: the first that fits)")
    exp.add_argument("--dtype", default="float32", help="float32 (exact) or bfloat16")
    exp.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file, e.g. 5GB, 500MB or 500KB (KB/MB/GB decimal; K/M/G and KiB/... binary)",
    )
    exp.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in --out (all its weights go; files put there by others stay)",
    )
    exp.add_argument(
        "--replace-tokenizer",
        action="store_true",
        help="write the run's tokenizer over one --out already has (default: keep that one)",
    )
    for q in (imp, exp):
        q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from xmoe_jax.units import parse_bytes

    # before anything loads
    shard_bytes = parse_bytes(args.max_shard_size, "--max-shard-size") if args.command == "export" else 0
    from xmoe_jax.launch.xla_flags import apply_defaults

    apply_defaults()
    quiet_logging()
    from xmoe_jax.hf.convert import export_checkpoint, import_checkpoint, next_steps

    with value_errors_are_bad_input():
        if args.command == "import":
            cfg = import_checkpoint(
                args.hf_dir, args.out, args.overrides, report=progress, allow_nonfinite=args.allow_nonfinite
            )
            print(next_steps(args.hf_dir, cfg))
        else:
            files = export_checkpoint(
                args.run_dir, args.out, args.step, args.arch, args.dtype, args.overrides, shard_bytes,
                overwrite=args.overwrite, replace_tokenizer=args.replace_tokenizer, report=progress,
            )  # fmt: skip
            print(f"exported {args.run_dir} to {args.out}: config.json, {', '.join(files)}")
    return 0
