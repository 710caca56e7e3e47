"""Real multi-process runs on CPU: local processes joined by jax.distributed (gloo collectives),
fake devices per process (8 in total), the real CLI and trainer.

The training test saves and resumes across layouts: 2 processes x 4 devices with the experts split
over both processes (expert=8), then 4 processes x 2 devices started through SLURM variables
(expert=4 spans two processes), then this process alone (expert=2). Its losses must equal a
single-process run's. With `data.shuffle=false` every layout reads the same sequences at each step
(each process's share of the global batch is a different slice of the same windows), so the
runs differ only in float32 reduction order: losses agree to ~1e-7 relative; we allow 2e-5.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest

from xmoe_jax.config import load_config
from xmoe_jax.train.loop import train

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
PHASE_TIMEOUT_S = 420
COMMON = ["train.log_every=1", "data.shuffle=false", "checkpoint.every=2", "checkpoint.keep=3"]


def _base_env() -> dict:
    drop = ("SLURM_", "XMOE_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _launch(tmp: pathlib.Path, name: str, devices: int, argv_env: list[tuple[list[str], dict]]) -> list[dict]:
    """Starts one `python -m xmoe_jax.cli` per (argv, env); waits; returns rc/stdout/stderr each."""
    procs = []
    for i, (argv, env) in enumerate(argv_env):
        out, err = tmp / f"{name}.{i}.out", tmp / f"{name}.{i}.err"
        flags = f"--xla_force_host_platform_device_count={devices}"
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "xmoe_jax.cli", *argv],
                    env={**_base_env(), "XLA_FLAGS": flags, **env},
                    cwd=REPO,
                    stdout=out.open("w"),
                    stderr=err.open("w"),
                ),
                out,
                err,
            )
        )
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    try:
        for proc, _, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc, _, _ in procs:
            proc.kill()
        pytest.fail(f"{name}: processes still running after {PHASE_TIMEOUT_S} s: {_tails(procs)}")
    return [{"rc": p.returncode, "out": o.read_text(), "err": e.read_text()} for p, o, e in procs]


def _tails(procs) -> str:
    return "\n".join(f"--- {e.name}\n{e.read_text()[-2000:]}" for _, _, e in procs)


def _cli_args(run_dir: pathlib.Path, *overrides: str) -> list[str]:
    sets = [f"train.run_dir={run_dir}", *COMMON, *overrides]
    return ["--config", str(TINY), *[x for s in sets for x in ("--set", s)]]


def _slurm_env(pid: int, ntasks: int, port: int) -> dict:
    return {
        "SLURM_JOB_ID": "99",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": f"{ntasks}(x1)",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(pid),
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": str(pid),
        "XMOE_COORDINATOR_PORT": str(port),
        "XMOE_INIT_TIMEOUT": "180",
    }


def _ok(results: list[dict], name: str) -> None:
    for i, r in enumerate(results):
        assert r["rc"] == 0, f"{name} process {i} exited {r['rc']}:\n{r['err'][-3000:]}"


@pytest.mark.slow  # ~70 s on 2 idle cores (3 min loaded): 6 processes each compile the step
def test_train_save_resume_across_process_counts_and_meshes(tmp_path, caplog):
    run = tmp_path / "run"
    ref_cfg = load_config(
        TINY,
        [f"train.run_dir={tmp_path / 'ref'}", *COMMON, "train.steps=6", "checkpoint.enabled=false"]
        + ["mesh.data=2", "mesh.expert=4"],
    )
    reference = train(ref_cfg).losses

    # A: 2 processes x 4 devices, explicit flags; 8 experts over 8 devices on two processes
    port = portpicker.pick_unused_port()
    argv = _cli_args(run, "train.steps=2", "mesh.data=1", "mesh.expert=8")
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--init-timeout", "180"]
    a = _launch(tmp_path, "a", 4, [([*argv, *flags, "--process-id", str(i)], {}) for i in range(2)])
    _ok(a, "2-process run")

    # B: 4 processes x 2 devices from SLURM variables, resumed; the expert axis spans 2 processes
    port = portpicker.pick_unused_port()
    argv = _cli_args(run, "train.steps=4", "mesh.data=2", "mesh.expert=4") + ["--resume"]
    b = _launch(tmp_path, "b", 2, [(argv, _slurm_env(i, 4, port)) for i in range(4)])
    _ok(b, "4-process resume")

    # C: this process alone (8 devices), experts over 2 devices, resumed
    cfg = load_config(
        TINY, [f"train.run_dir={run}", *COMMON, "train.steps=6", "mesh.data=4", "mesh.expert=2"]
    )
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        train(cfg, resume=True)

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # one writer, no duplicates
    np.testing.assert_allclose([r["loss"] for r in records], [reference[s] for s in range(1, 7)], rtol=2e-5)

    # process 0 logs; the others print nothing but gloo's connection lines
    for results, steps in ((a, (1, 2)), (b, (3, 4))):
        assert all(f"step {s:>6}/" in results[0]["out"] for s in steps) and "done:" in results[0]["out"]
        for r in results[1:]:
            assert "step " not in r["out"] and "done:" not in r["out"] and "INFO" not in r["err"]
    assert "jax.distributed: 4 processes, coordinator localhost:" in b[0]["err"]
    # the data position is per process: a new process count restarts the stream at the step
    assert "written by 2 process(es), this run has 4" in b[0]["err"]
    assert "written by 4 process(es), this run has 1" in caplog.text
    # every process wrote its own shards and data position
    for step, n in ((2, 2), (4, 4)):
        data = sorted(p.name for p in (run / "checkpoints" / str(step) / "data").glob("process_*.json"))
        assert data == [f"process_{i}-of-{n}.json" for i in range(n)]


def test_unreachable_coordinator_fails_within_the_timeout(tmp_path):
    port = portpicker.pick_unused_port()  # nobody listens there
    argv = _cli_args(tmp_path / "run", "train.steps=1")
    argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"]
    t0 = time.monotonic()
    (r,) = _launch(tmp_path, "unreachable", 4, [([*argv, "--init-timeout", "3"], {})])
    assert r["rc"] == 2, r["err"]
    assert f"could not reach the coordinator at 127.0.0.1:{port} within 3 s" in r["err"]
    assert "--coordinator HOST:PORT" in r["err"]
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "run").exists()


def test_process_zero_alone_times_out_with_a_message(tmp_path):
    port = portpicker.pick_unused_port()
    argv = _cli_args(tmp_path / "run", "train.steps=1")
    argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]
    (r,) = _launch(tmp_path, "alone", 4, [([*argv, "--init-timeout", "3"], {})])
    assert r["rc"] == 2, r["err"]
    assert f"not all 2 processes joined the coordinator at 127.0.0.1:{port} within 3 s" in r["err"]


def test_mesh_that_does_not_fit_the_devices_fails_on_every_process(tmp_path):
    port = portpicker.pick_unused_port()
    argv = _cli_args(tmp_path / "run", "train.steps=1", "mesh.data=2", "mesh.expert=4")  # 8 > 2 x 2
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--init-timeout", "120"]
    results = _launch(tmp_path, "mesh", 2, [([*argv, *flags, "--process-id", str(i)], {}) for i in range(2)])
    for r in results:
        assert r["rc"] == 2, r["err"]
        assert "2*4*1 = 8 != 4 devices" in r["err"]  # both sizes, before anything compiled
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # ~40 s: 2 processes each compile the step
def test_rbd_node_axis_across_processes_matches_single_process(tmp_path):
    """RBD with the node axis across 2 processes x 4 devices (2 nodes of 4) trains exactly like
    one process running the dense oracle: stage 1 crosses processes over gloo."""
    moe = ["parallel.dispatch=rbd", "checkpoint.enabled=false", "train.steps=3"]
    ref_cfg = load_config(
        TINY,
        [f"train.run_dir={tmp_path / 'ref'}", *COMMON, "train.steps=3", "checkpoint.enabled=false"]
        + ["mesh.data=1", "mesh.expert=8", "parallel.dispatch=dense"],
    )
    reference = train(ref_cfg).losses
    run = tmp_path / "rbd"
    port = portpicker.pick_unused_port()
    argv = _cli_args(run, *moe, "mesh.data=1", "mesh.expert=8", "mesh.expert_nodes=2")
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--init-timeout", "180"]
    results = _launch(tmp_path, "rbd", 4, [([*argv, *flags, "--process-id", str(i)], {}) for i in range(2)])
    _ok(results, "2-process rbd run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in records], [reference[s] for s in (1, 2, 3)], rtol=2e-5)


@pytest.mark.slow  # ~90 s on 2 idle cores (6 min loaded): one process and two compile the step
def test_bench_as_two_processes_matches_one_process_and_exits_cleanly(tmp_path):
    """scripts/bench_train_step.py as 2 processes x 2 devices (`python -m xmoe_jax.launch.local`,
    explicit coordinator) against one process with 4 devices: same mesh (expert=4), seed and
    sequences. Both exit 0 with no coordination-service noise. On CPU the losses differ in the
    last bits (gloo sums the cross-process partial sums in another order than XLA's in-process
    all-reduce: 5e-7 at most over 10 steps); on GPUs NCCL runs both (scripts/gpu_bench_procs.sh
    reports whether they are bitwise equal)."""
    from xmoe_jax.launch import local

    bench = [sys.executable, str(REPO / "scripts" / "bench_train_step.py"), "--config", str(TINY),
             "--steps", "10", "--matmul-size", "64"]  # fmt: skip
    for s in ("mesh.data=1", "mesh.expert=4", "parallel.dispatch=pft", "model.moe.capacity_factor=null",
              "data.shuffle=false", "train.tensorboard=false"):  # fmt: skip
        bench += ["--set", s]
    env = {**_base_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    one = subprocess.run([*bench, "--out", str(tmp_path / "one.json")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=PHASE_TIMEOUT_S)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    results = local.run([*bench, "--out", str(tmp_path / "two.json")], 2, tmp_path / "logs", env=env,
                        timeout_s=PHASE_TIMEOUT_S)  # fmt: skip
    for r in results:
        log = r.log.read_text()
        assert r.returncode == 0, log[-3000:]
        assert r.noise == 0, local.noise_lines(log)
    single, multi = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (single["num_processes"], multi["num_processes"]) == (1, 2)
    out = local.compare_runs(single, multi)
    assert out["steps"] == 10
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=2e-6)
