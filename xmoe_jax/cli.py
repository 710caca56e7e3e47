"""Command-line entry points: `xmoe-train`, `xmoe-params`, `xmoe-plan`, `xmoe-tokenize`, `xmoe-eval`,
`xmoe-plot`, `xmoe-generate`, `xmoe-convert`.

    xmoe-train --config configs/tiny.yaml [--set model.moe.top_k=4 ...] [--resume | --resume-or-start] [--new-data]
    xmoe-train ... --coordinator HOST:PORT --num-processes N --process-id I   # multi-process
    xmoe-params --config configs/small.yaml
    xmoe-tokenize --input 'corpus/*.jsonl' --tokenizer tokenizer.json --output data/corpus
    xmoe-eval --run-dir runs/mine [--step 200] [--set eval.holdout=0.01]
    xmoe-plot --run-dir runs/mine
    xmoe-generate --run-dir runs/tiny --prompt "To be" [--max-tokens 64 --temperature 0.8 ...]
    xmoe-convert import --hf-dir DIR --out RUN_DIR / export --run-dir RUN_DIR --out DIR

Exit status of `xmoe-train` (docs/reliability.md):
    0   the run finished (or, resumed, had already finished);
    1   it failed: a non-finite loss under train.nan_policy=stop, another process of the job
        died or failed (`xmoe_jax.launch.peers`), or an unexpected error;
    2   bad input, before anything compiled: config, data, run directory (a file, read-only,
        or in use by another trainer), an incompatible checkpoint or none that restores intact;
    75  stopped by a signal of train.stop_signals (EX_TEMPFAIL) after saving a checkpoint: run the
        same command with --resume (the SLURM scripts requeue the job); or at once before the
        first step ran (restoring, compiling), nothing saved: run the same command again.
Errors print one line naming the problem and the fix.

`xmoe-generate` and `xmoe-convert` (the commands that read or write a model) are in
`xmoe_jax.cli_models`; they share `command` and the helpers below.

The launch flags (`add_cli_flags`) and the call that turns them into a started job
(`initialize_from_args`) live here too; `scripts/launch_plan.py` shares them. How flags,
XMOE_* variables and SLURM combine is `xmoe_jax.launch.distributed`'s rule.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import traceback
from pathlib import Path

from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.errors import XmoeError
from xmoe_jax.launch import distributed

DEFAULT_CONFIG_HELP = "YAML config (default: the built-in tiny defaults)"


def _add_overrides(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted override, e.g. --set {example} (repeatable)",
    )


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", default=None, help=DEFAULT_CONFIG_HELP)
    _add_overrides(p, "train.steps=50")
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


def _launch(args: argparse.Namespace, start):
    off = args.no_distributed or os.environ.get("XMOE_DISTRIBUTED", "1").lower() in ("0", "false", "no")
    if off and (args.coordinator or args.num_processes or args.process_id is not None):
        raise distributed.DistributedError(
            "--no-distributed conflicts with --coordinator/--num-processes/--process-id"
        )
    return start(
        args.coordinator,
        args.num_processes,
        args.process_id,
        args.local_device_ids,
        args.init_timeout,
        auto=not off,
        peer_timeout_s=getattr(args, "peer_timeout", None),
    )


def initialize_from_args(args: argparse.Namespace) -> distributed.LaunchPlan:
    """`distributed.initialize()` from the flags of `add_cli_flags`; `--no-distributed` forces one process."""
    return _launch(args, distributed.initialize)


def resolve_from_args(args: argparse.Namespace) -> distributed.LaunchPlan:
    """The launch plan of those flags without starting anything (no JAX import)."""
    return _launch(args, distributed.resolve)


def _fail(err: XmoeError) -> int:
    """`error: <message>` on stderr; the exit status the error carries (xmoe_jax/errors.py)."""
    print(f"error: {err}", file=sys.stderr)
    return err.exit_code


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C ended


def _exit_at_exit(code: int) -> None:
    """The last step of a process Ctrl-C stopped: flush and leave at once. Interrupted while orbax
    or tensorstore read a checkpoint, their native threads crash the interpreter's teardown
    (a segmentation fault, status 139, in about 1 of 3 tries)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def _noting_ctrl_c(seen: list[int]):
    """Appends to `seen` when Ctrl-C arrives; SIGINT still raises KeyboardInterrupt
    as Python's own handler does. Why: a library that catches it mid-wait may raise it on as
    another error (orbax, interrupted while restoring a checkpoint, says the step "is damaged"),
    which must still be reported as the interruption it was. Installed only over Python's default
    handler on the main thread: a background job's ignored SIGINT stays ignored, and a tool's own
    handler (xmoe-train's stop signals, installed while it trains) takes precedence."""

    def note(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    install = threading.current_thread() is threading.main_thread()
    install = install and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, note) if install else None
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGINT, previous)


def command(main):
    """Every entry point's error handling: an `XmoeError` becomes its one line and exit status
    (2 bad input, 1 failed while running); Ctrl-C one line and 130, whatever error it turned into
    on the way (`_noting_ctrl_c`); anything else is a bug and keeps its traceback. (`xmoe-train`
    turns SIGINT into an orderly stop while it trains: train.stop_signals.)"""

    def interrupted(ctrl_c: list[int]) -> int:
        print(f"interrupted (Ctrl-C): xmoe-{main.__name__.removesuffix('_main')} stopped", file=sys.stderr)
        if ctrl_c:  # a real SIGINT: leave without the teardown (`_exit_at_exit`)
            atexit.register(_exit_at_exit, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        ctrl_c: list[int] = []
        with _noting_ctrl_c(ctrl_c):
            try:
                return main(argv)
            except KeyboardInterrupt:
                return interrupted(ctrl_c)
            except XmoeError as err:
                return interrupted(ctrl_c) if ctrl_c else _fail(err)
            except Exception:
                if ctrl_c:
                    return interrupted(ctrl_c)
                raise

    return run


def progress(line: str) -> None:
    """A long tool's progress line (loading, compiling, writing): stderr, at once."""
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def value_errors_are_bad_input():
    """A plain ValueError from the libraries a tool calls (a tokenizer, a placement check) as bad
    input: the same message, status 2."""
    try:
        yield
    except ValueError as err:
        if isinstance(err, XmoeError):
            raise
        raise ConfigError(str(err)) from err


@command
def train_main(argv: list[str] | None = None) -> int:
    p = _parser("xmoe-train", "Train a DeepSeek-style MoE transformer.")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in train.run_dir from its newest intact checkpoint (step 0 if it has "
        "none yet); refused if train.run_dir does not exist",
    )
    p.add_argument(
        "--resume-or-start",
        action="store_true",
        help="as --resume, but a train.run_dir that does not exist starts a new run there: for the "
        "first submission of a job that resumes itself (requeues, restart loops)",
    )
    p.add_argument(
        "--new-data",
        action="store_true",
        help="with --resume: accept data other than the checkpoint's (re-tokenized, edited, another "
        "corpus); the model and optimizer resume, the data starts at its position 0",
    )
    p.add_argument(
        "--compile-cache",
        metavar="DIR|off",
        default=None,
        help="JAX's persistent compilation cache: a second start reads the compiled step from here "
        "(env XMOE_COMPILE_CACHE; default ~/.cache/xmoe_jax/jax; off: none)",
    )
    add_cli_flags(p)
    args = p.parse_args(argv)
    if args.new_data and not (args.resume or args.resume_or_start):
        p.error("--new-data applies only with --resume or --resume-or-start")
    quiet_logging()
    cfg = load_config(args.config, args.overrides)  # plain Python: JAX's backend has not started
    if resolve_from_args(args).process_id == 0:  # the first line, before JAX loads and compiles
        _start_line(args.config, cfg)
    from xmoe_jax.launch.xla_flags import apply_defaults

    # before anything starts JAX's backend
    apply_defaults(scheduler=cfg.parallel.xla_scheduler, transport=cfg.parallel.transport)
    launch = initialize_from_args(args)  # before any other JAX use
    distributed.quiet_unless_main(launch)
    from xmoe_jax.launch import compile_cache, peers

    compile_cache.enable(args.compile_cache)  # before the first compile; says where, or off and why
    from xmoe_jax.train import preemption
    from xmoe_jax.train.loop import train
    from xmoe_jax.train.preemption import PREEMPTED_EXIT_CODE, Preempted

    watch = peers.watch(launch)  # several processes: stop when another dies
    result, message = None, ""
    try:
        resume = args.resume or args.resume_or_start
        # a late stop signal must not turn status 75 into death by signal
        with preemption.ignoring_after_stop():
            result = train(cfg, resume=resume, start_if_missing=args.resume_or_start, new_data=args.new_data)
        code = 0
    except Preempted:  # the loop logged where it saved
        code = PREEMPTED_EXIT_CODE
    except XmoeError as err:  # its line and status here: every process still leaves together below
        code, message = _fail(err), str(err)
    except Exception as err:
        if not launch.is_multi_process:
            raise  # the traceback, status 1
        traceback.print_exc()
        watch.fail(f"{type(err).__name__}: {err}")  # tells the others, names silent peers, exits 1
    watch.leave(code, message)  # every process ends here together: leave in order
    distributed.shutdown()
    if result is not None and result.already_finished and launch.process_id == 0:
        print(f"already finished: step {result.final_step} = train.steps, run dir {cfg.train.run_dir}")
    elif result is not None and launch.process_id == 0:
        last = result.records[-1] if result.records else {}
        print(
            f"done: step {result.final_step}, loss {last.get('loss', float('nan')):.4f}, "
            f"run dir {cfg.train.run_dir}"
        )
    return code


def _start_line(config_path: str | None, cfg) -> None:
    """The start-up summary's first line: config, run directory, parameters (the loop adds data,
    devices and mesh, then says when it compiles)."""
    from xmoe_jax.params import count_params
    from xmoe_jax.units import format_count

    counts = count_params(cfg.model)
    logging.getLogger("xmoe_jax").info(
        "config %s; run dir %s; %s parameters (%s active per token)",
        config_path or "(built-in tiny defaults)",
        cfg.train.run_dir,
        format_count(counts.total),
        format_count(counts.active),
    )


@command
def params_main(argv: list[str] | None = None) -> int:
    p = _parser("xmoe-params", "Print the parameter counts of a model config.")
    args = p.parse_args(argv)
    from xmoe_jax.params import format_param_table

    cfg = load_config(args.config, args.overrides)
    print(format_param_table(cfg.model))
    return 0


def _check_out_file(path: Path, flag: str) -> None:
    """An output file's path: its folder exists (a folder, not a file) and it is not a folder itself."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; name a file in it, e.g. {path / 'plan.json'}")
    parent = path.parent
    for above in (parent, *parent.parents):
        if above.exists() and not above.is_dir():
            raise ConfigError(f"{flag} {path}: {above} is a file, not a folder; name a file in a folder")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {parent} does not exist; create it (mkdir -p {parent})")


@command
def plan_main(argv: list[str] | None = None) -> int:
    p = _parser(
        "xmoe-plan", "Per-device memory of a config's train step on N devices (ahead-of-time compile)."
    )
    p.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    p.add_argument(
        "--device-memory",
        default=None,
        help="memory per device, e.g. 64GiB, 64G or 80GB (KB/MB/GB/TB decimal; K/M/G/T and KiB/... binary)",
    )
    p.add_argument(
        "--real-devices", action="store_true", help="compile for this host's accelerators (count must match)"
    )
    p.add_argument("--out", default=None, help="also write the plan as JSON here")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also print state bytes per parameter and activation bytes per token per layer by category",
    )
    args = p.parse_args(argv)
    if args.devices < 1:
        raise ConfigError(f"--devices={args.devices} must be >= 1")
    if args.out:  # before minutes of compiling, not after
        _check_out_file(Path(args.out), "--out")
    from xmoe_jax.units import parse_bytes

    memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
    if not args.real_devices:  # before JAX starts: N fake CPU devices, Pallas kernels (see xmoe_jax/plan.py)
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("XMOE_KERNELS", "shapes")
    from xmoe_jax.launch.xla_flags import apply_defaults

    apply_defaults()
    import jax

    from xmoe_jax.plan import plan

    with value_errors_are_bad_input():
        cfg = load_config(args.config, args.overrides)
        if jax.device_count() != args.devices:
            raise ConfigError(
                f"--devices={args.devices} but JAX has {jax.device_count()} devices "
                f"({'set by XLA_FLAGS already' if not args.real_devices else 'this host'}); "
                "plan for the devices there are, or run in a fresh process"
            )
        result = plan(
            cfg, memory, progress=lambda line: print(f"xmoe-plan: {line}", file=sys.stderr, flush=True)
        )
    print(result.table())
    if args.breakdown:  # the state's bytes per parameter are in the table already
        from xmoe_jax.perf.breakdown import activation_breakdown

        acts = activation_breakdown(cfg)
        print("\n".join(acts.table()))
        result.notes.append("activations kept, bytes by category: " + json.dumps(acts.per_category))
    if args.out:
        try:
            with open(args.out, "w") as f:
                json.dump(result.as_dict(), f, indent=1)
        except OSError as e:  # checked before compiling; a permission or a full disk shows here
            raise ConfigError(
                f"--out {args.out} is not writable ({e.strerror or e}); name a writable file"
            ) from e
    return 0


def _one_line_orbax_errors(record: logging.LogRecord) -> bool:
    """Orbax logs each failed background write with its traceback, from several threads (a full disk
    printed ~1,400 lines, then four long lines); the trainer reports the failure itself in one line
    (`CheckpointWriteError`), so drop orbax's own, and asyncio's copy of a storage error orbax
    already logged; any other logged exception keeps one line."""
    if record.name not in ("absl", "asyncio") or not record.exc_info:  # orbax logs through both
        return True
    frames = traceback.walk_tb(record.exc_info[2])
    if record.name == "absl" and any(f"{os.sep}orbax{os.sep}" in f.f_code.co_filename for f, _ in frames):
        return False  # raised in orbax and on to the caller, which says it in one line
    if record.name == "asyncio" and "os_error_code" in str(record.exc_info[1]):
        return False  # "Task exception was never retrieved": the failed write, once more
    record.msg, record.args = record.getMessage().splitlines()[0][:300], None
    record.exc_info, record.exc_text = None, None
    return True


def _drop_closed_loop_callbacks(unraisable) -> None:
    """After a failed checkpoint write orbax closes that save's event loop, and the tensorstore writes
    still in flight call back into it: each raises "Event loop is closed" with its traceback (about
    100 on a full disk). The failed write is reported in one line. A Ctrl-C that landed in a callback
    Python cannot raise from (JAX's garbage-collection hook) would be lost with a traceback printed:
    it is sent again, to land where it stops the tool (`command`). Everything else prints as usual."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return
    if isinstance(exc, KeyboardInterrupt):
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    sys.__unraisablehook__(unraisable)


def quiet_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("xmoe_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_one_line_orbax_errors)
    sys.unraisablehook = _drop_closed_loop_callbacks


@command
def tokenize_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="xmoe-tokenize",
        description="Tokenize .txt/.jsonl/.parquet documents into ArrayRecord shards for data.path "
        "(rerun the same command to resume an interrupted job).",
    )
    p.add_argument("--input", required=True, help="a file, a folder or a quoted glob of documents")
    p.add_argument(
        "--tokenizer", required=True, help="tokenizer.json, tokenizer directory, .model or 'bytes'"
    )
    p.add_argument("--output", required=True, help="directory for the shards and manifest.json")
    p.add_argument(
        "--text-field", default="text", help="text field of .jsonl/.parquet documents (default: text)"
    )
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^27)")
    args = p.parse_args(argv)
    from xmoe_jax.data.tokenize import DEFAULT_SHARD_TOKENS, tokenize_to_shards

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    out = pathlib.Path(args.output)  # created with its parents; a file in the way: tokenize_to_shards
    try:
        summary = tokenize_to_shards(
            args.input,
            args.tokenizer,
            out,
            text_field=args.text_field,
            shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
            report=report,
            lock=_tokenize_lock,
        )
    except KeyboardInterrupt:  # the unfinished shard is dropped; the finished ones stay
        print(
            f"xmoe-tokenize: interrupted; the finished shards in {out} are kept: run the same command to resume",
            file=sys.stderr,
        )
        return 130
    print(f"done: {summary}")
    return 0


@contextlib.contextmanager
def _tokenize_lock(out: pathlib.Path):
    """One xmoe-tokenize per output folder: the trainer's lock (`runlock.RunLock`), in the output.
    A lock file that could not be written whole (a full disk) is removed: it would refuse the rerun."""
    from xmoe_jax import storage
    from xmoe_jax.data.tokenize import LOCK_NAME
    from xmoe_jax.train.runlock import RunLock

    lock = RunLock(out, out / LOCK_NAME, "another xmoe-tokenize", "choose another --output")
    try:
        with storage.writing(lock.path):
            lock.acquire()
    except storage.WriteError:
        try:
            json.loads(lock.path.read_text())  # whole: a holder's, kept
        except (OSError, ValueError):  # the half this process wrote
            with contextlib.suppress(OSError):
                lock.path.unlink()
        raise
    try:
        yield
    finally:
        lock.release()


@command
def eval_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="xmoe-eval", description="Evaluate a checkpoint of a run on its eval data (loss, perplexity)."
    )
    p.add_argument("--run-dir", required=True, help="the run directory xmoe-train wrote")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    _add_overrides(p, "eval.data.path=valid.jsonl")
    args = p.parse_args(argv)
    from xmoe_jax.launch.xla_flags import apply_defaults

    apply_defaults()
    quiet_logging()
    from xmoe_jax.train.evaluate import evaluate_checkpoint

    r = evaluate_checkpoint(args.run_dir, args.step, args.overrides)
    print(
        f"step {r['step']}: eval loss {r['eval_loss']:.4f}, perplexity {r['eval_ppl']:.2f} ({r['eval_tokens']:,} tokens)"
    )
    return 0


@command
def plot_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="xmoe-plot", description="Write PNGs of a run (loss, eval, expert load)."
    )
    p.add_argument("--run-dir", required=True, help="the run directory xmoe-train wrote")
    p.add_argument("--out", default=None, help="output folder (default: <run-dir>/plots)")
    args = p.parse_args(argv)
    from xmoe_jax.plot import plot_run

    written = plot_run(args.run_dir, args.out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
