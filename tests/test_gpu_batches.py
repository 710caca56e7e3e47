"""The GPU batches (scripts/gpu_bench_*.sh, scripts/bench_peers.sh) run as documented (issue 37
section 2): scripts/bench_train_step.py carries its --steps into the config before the load-time
checks read it, and every batch has a CPU dry run (DRY_RUN=1: tiny shapes, fake devices, few steps;
scripts/gpu_env.sh) in the slow suite, so a config change cannot break a batch unseen."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import time

import pytest

from xmoe_jax.config import load_config
from xmoe_jax.launch import xla_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
# CI's time for the dry runs (.ci/run sets it to what its 90 minutes leave): a dry run that would start
# after it is spent is skipped, saying so, instead of failing CI by its clock
BATCH_BUDGET_S = float(os.environ.get("XMOE_BATCH_BUDGET_S", "inf"))
_START = time.monotonic()


def _bench_train_step():
    spec = importlib.util.spec_from_file_location(
        "bench_train_step", REPO / "scripts" / "bench_train_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_train_step_checks_the_config_with_its_own_steps(monkeypatch):
    """gpu_bench_depth.sh's run: configs/small.yaml (train.steps=50) with --steps 100 and a trace of
    steps 60-61 was refused at load ("starts after the last step (train.steps=50)")."""
    bench = _bench_train_step()
    argv = ["--config", str(REPO / "configs" / "small.yaml"), "--steps", "100", "--log-every", "10",
            "--set", "train.profile_steps=[60,61]", "--set", "mesh.expert=4", "--set", "mesh.data=1"]  # fmt: skip
    loaded = []

    class Loaded(Exception):
        pass

    def first_load(path, overrides):
        loaded.append(load_config(path, overrides))  # the checks run here
        raise Loaded

    monkeypatch.setattr(bench, "load_config", first_load)
    monkeypatch.setattr(sys, "argv", ["bench_train_step.py", *argv])
    with pytest.raises(Loaded):
        bench.main()
    (cfg,) = loaded
    assert (cfg.train.steps, cfg.train.log_every, cfg.train.profile_steps) == (100, 10, (60, 61))
    assert not cfg.checkpoint.enabled


# (script, arguments, environment, steps allowed to fail on the CPU: name -> why)
TORCH = "torch.distributed over GPUs: no torch or NCCL on the CPU"
GPU_ONLY = "a GPU-only XLA flag or kernel"
# jaxlib 0.10's XLA does not know the send/recv preset's flag: the step is refused at once, naming the fix
OLD_XLA = {"moe_layer_ep2_sendrecv": "XMOE_RAGGED_A2A=sendrecv needs jax>=0.11"} if xla_flags.unknown_flags(
    xla_flags.RAGGED_A2A_PRESETS["sendrecv"]) else {}  # fmt: skip
DRY_RUNS = [
    ("gpu_bench_depth.sh", [], {}, {}),
    ("gpu_bench_deepseek.sh", ["h100"], {}, {}),
    ("gpu_bench_deepseek.sh", ["x4"], {}, {}),
    ("gpu_bench_exchange.sh", [], {"ROWS": "64"}, {"ex_torch": TORCH, "ex_memcpy": GPU_ONLY}),
    ("gpu_bench_overlap.sh", ["ladder", "2"], {}, {}),
    ("gpu_bench_overlap.sh", ["ways", "2"], {}, {}),
    ("gpu_bench_pft.sh", ["h100"], {}, {}),
    ("gpu_bench_pft.sh", ["ep2"], {}, OLD_XLA),
    ("gpu_bench_procs.sh", [], {"N": "2", "STEPS": "10"}, {}),
    *[("gpu_bench_rbd.sh", [part], {}, {}) for part in ("layers", "train", "exchange", "buffer", "rerun", "backward")],
    *[("gpu_bench_scale.sh", [part], {}, {"repro_default": GPU_ONLY, "repro_sendrecv": GPU_ONLY})
      for part in ("h100a", "h100b", "x2a", "x2b", "x2c", "x2d")],
    ("bench_peers.sh", [], {"PEERS_ROWS": "xmoe_none xmoe_full xmoe_ep4", "PEERS_BUDGET": "20000"}, {}),
    ("gpu_bench_push.sh", [], {"ROWS": "64", "QUICK_ROWS": "64", "CHECK_ROWS": "16", "PUSH": "4,4x3"}, {"ex_torch": TORCH}),
    ("gpu_bench_push.sh", ["overlap depth_mem"], {"PARTS": "overlap depth_mem", "ROWS": "64"}, {}),
    (
        "gpu_bench_push.sh",
        ["depth_shrink depth_tgmm depth_stacks depth_source depth_unfused depth_sized depth_arrive gmm_push arrive"],
        {
            "PARTS": "depth_shrink depth_tgmm depth_stacks depth_source depth_unfused depth_sized depth_arrive gmm_push arrive",
            "DEPTH_STEPS": "2", "DEPTH_LAYERS": "12", "GMM_PUSH_ARGS": "--tiny",
        },
        {},
    ),
    ("gpu_bench_fused.sh", [], {"GATHER_ARGS": "--tiny", "PEERS_ROWS": "xmoe_none"}, {}),
    ("gpu_bench_fused.sh", ["depth"], {"PART": "depth", "DEPTH_TRANSPORT": "bucketed"}, {}),
    ("gpu_bench_fused.sh", ["ab"], {"PART": "ab", "AB_ENV": "XMOE_GMM_GATHER=xla;XMOE_TGMM_GATHER=kernel"}, {}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.batch
@pytest.mark.parametrize(
    "script, args, env, may_fail", DRY_RUNS, ids=[" ".join([case[0], *case[1]]) for case in DRY_RUNS]
)
def test_every_gpu_batch_runs_on_the_cpu(script, args, env, may_fail, tmp_path):
    """DRY_RUN=1 (scripts/gpu_env.sh): the batch as written, on fake CPU devices with tiny shapes.
    Every step must exit 0 (a config the batch's runs are refused on fails here), save those that
    need a GPU by nature."""
    import re
    import signal
    import subprocess

    left = BATCH_BUDGET_S - (time.monotonic() - _START)
    if left < 120:
        pytest.skip(
            f"CI's budget for the GPU batches' dry runs (XMOE_BATCH_BUDGET_S={BATCH_BUDGET_S:.0f}) is spent; "
            "run them with python -m pytest -m batch"
        )
    run_env = {**os.environ, **env, "DRY_RUN": "1", "OUT": str(tmp_path / "out"), "PYTHONPATH": str(REPO)}
    run_env.pop("XLA_FLAGS", None)  # conftest's 8 fake devices: gpu_env.sh sets its own
    limit = min(7200, max(left, 120))
    proc = subprocess.Popen(["bash", f"scripts/{script}", *args], cwd=REPO, env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the batch and every step it started
        stdout, stderr = proc.communicate()
        assert limit < 7200, f"{script} ran past 2 hours\n{stdout[-3000:]}"
        pytest.skip(f"stopped at CI's budget for the GPU batches' dry runs ({limit:.0f} s were left)")
    out = stdout + stderr
    steps = dict(re.findall(r"^(\S+) rc=(\d+) \d+s", stdout, re.MULTILINE))
    assert steps, out[-3000:]
    failed = {name: rc for name, rc in steps.items() if rc != "0" and name not in may_fail}
    assert not failed, f"{failed}\n{out[-5000:]}"
    assert "ConfigError" not in out, out[-5000:]
