"""One job as several processes on this host with an explicit coordinator (one process per GPU, as a
cluster runs it, without SLURM), and the check that such a run equals the single-process one.

    python -m xmoe_jax.launch.local run -n 4 --one-device-each --logs OUT/procs4 -- \
        python3 scripts/bench_train_step.py --config configs/tiny_small_shape.yaml --out OUT/procs4.json
    python -m xmoe_jax.launch.local compare OUT/single.json OUT/procs4.json

`run` starts N copies of the command, each given `xmoe-train`'s launch flags: `--coordinator
127.0.0.1:PORT` (a free port), `--num-processes N`, `--process-id I`, and with --one-device-each
`--local-device-ids I` (process I drives GPU I). Each process's stdout and stderr go to
`<logs>/<I>.log`. When one exits non-zero the others get `--grace` seconds to stop by themselves
(the peer watch of `xmoe_jax.launch.peers` names the failed process) and are then killed. Exit
status: the first process's non-zero status in process order, else 0; one line per process says
its status, seconds and log, and how many lines of the log are known shutdown noise
(`NOISE`: coordination-service warnings, JAX's heartbeat abort, a leaked client).

`compare` reads two results of scripts/bench_train_step.py (every step's loss under `losses`) and
prints tokens/s of each, their ratio and whether the losses are bitwise equal (exit 0 either way;
the JSON line is for scripts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

NOISE = (
    "WatchTasksAsync",
    "Connection refused",
    "coordination service",
    "Terminating process",
    "heartbeat",
    "Check failure",
    "jax.Client was leaked",
    "Traceback",
)


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    process_id: int
    returncode: int
    seconds: float
    log: Path
    noise: int  # lines of the log holding a NOISE marker


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_argv(
    command: Sequence[str], i: int, n: int, port: int, one_device_each: bool, host: str = "127.0.0.1"
) -> list[str]:
    """The command of process `i` of `n`: the launch flags of `xmoe-train` appended."""
    argv = [*command, "--coordinator", f"{host}:{port}", "--num-processes", str(n), "--process-id", str(i)]
    return argv + (["--local-device-ids", str(i)] if one_device_each else [])


def noise_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(marker in line for marker in NOISE)]


def run(
    command: Sequence[str],
    num_processes: int,
    logs: Path,
    *,
    one_device_each: bool = False,
    port: int | None = None,
    grace_s: float = 90.0,
    timeout_s: float | None = None,
    env: dict | None = None,
) -> list[ProcessResult]:
    """Starts the processes, waits for all (see the module docstring), returns each one's result."""
    if num_processes < 1:
        raise ValueError(f"-n {num_processes}: need at least one process")
    port = port or free_port()
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs, files = [], []
    for i in range(num_processes):
        log = (logs / f"{i}.log").open("w")
        files.append(log)
        argv = process_argv(command, i, num_processes, port, one_device_each)
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
    ended: dict[int, float] = {}
    first_failure: float | None = None
    try:
        while len(ended) < num_processes:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = now - t0
                    if p.returncode != 0 and first_failure is None:
                        first_failure = now
            late = first_failure is not None and now - first_failure > grace_s
            if late or (timeout_s is not None and now - t0 > timeout_s):
                for i, p in enumerate(procs):
                    if i not in ended:
                        p.kill()
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    results = []
    for i, p in enumerate(procs):
        log = logs / f"{i}.log"
        results.append(
            ProcessResult(i, p.returncode, ended.get(i, 0.0), log, len(noise_lines(log.read_text())))
        )
    return results


def compare_runs(single: dict, multi: dict) -> dict:
    """tokens/s of both, their ratio, and whether every step's loss is bitwise equal."""
    a, b = single.get("losses") or [], multi.get("losses") or []
    diff = next((i + 1 for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return {
        "single_tokens_per_s": single["tokens_per_s"],
        "multi_tokens_per_s": multi["tokens_per_s"],
        "ratio": multi["tokens_per_s"] / single["tokens_per_s"],
        "single_processes": single.get("num_processes", 1),
        "multi_processes": multi.get("num_processes"),
        "steps": min(len(a), len(b)),
        "losses_bitwise_equal": bool(a) and len(a) == len(b) and diff is None,
        "first_differing_step": diff,
        "max_abs_loss_diff": max((abs(x - y) for x, y in zip(a, b, strict=False)), default=None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start N processes of a command (after --)")
    r.add_argument("-n", "--num-processes", type=int, required=True)
    r.add_argument("--one-device-each", action="store_true", help="process I gets --local-device-ids I")
    r.add_argument("--logs", default="procs", help="folder for <process id>.log")
    r.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    r.add_argument("--grace", type=float, default=90.0, help="seconds the others get after one fails")
    r.add_argument("--timeout", type=float, default=None, help="kill every process after this long")
    r.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare", help="a single-process and a multi-process bench_train_step.py JSON")
    c.add_argument("single")
    c.add_argument("multi")
    args = p.parse_args(argv)
    if args.cmd == "compare":
        single, multi = (json.loads(Path(f).read_text()) for f in (args.single, args.multi))
        out = compare_runs(single, multi)
        print(
            f"tokens/s: {out['single_processes']} process {out['single_tokens_per_s']:,.0f}, "
            f"{out['multi_processes']} processes {out['multi_tokens_per_s']:,.0f} (ratio {out['ratio']:.3f}); "
            f"{out['steps']} losses bitwise equal: {out['losses_bitwise_equal']}"
            + (
                f" (first differing step {out['first_differing_step']})"
                if out["first_differing_step"]
                else ""
            )
        )
        print(json.dumps(out))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("run: give the command after --")
    results = run(
        command,
        args.num_processes,
        Path(args.logs),
        one_device_each=args.one_device_each,
        port=args.port,
        grace_s=args.grace,
        timeout_s=args.timeout,
    )
    for res in results:
        print(
            f"process {res.process_id}: status {res.returncode}, {res.seconds:.0f} s, "
            f"{res.noise} shutdown-noise lines, log {res.log}"
        )
    return next((res.returncode for res in results if res.returncode != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
