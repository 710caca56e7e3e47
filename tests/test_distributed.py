"""Launch planning without starting processes: SLURM parsing, device choice, errors, scripts."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from xmoe_jax import cli
from xmoe_jax.config import ConfigError, DataConfig, load_config
from xmoe_jax.data import make_input
from xmoe_jax.launch import distributed
from xmoe_jax.launch.distributed import DistributedError, plan
from xmoe_jax.launch.slurm import expand_hostlist
from xmoe_jax.train.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def slurm(pid: int, ntasks: int, nodelist: str = "node[001-002]", per_node: int | None = None, **extra):
    """The variables srun sets for task `pid` (block distribution)."""
    num_nodes = len(expand_hostlist(nodelist))
    per_node = per_node or ntasks // num_nodes
    env = {
        "SLURM_JOB_ID": "4100",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(num_nodes),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{num_nodes})",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(pid),
        "SLURM_NODEID": str(pid // per_node),
        "SLURM_LOCALID": str(pid % per_node),
    }
    return {**env, **{k: str(v) for k, v in extra.items()}}


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node001", ["node001"]),
        ("node001,host2", ["node001", "host2"]),
        ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
        ("frontier[08998-09001]", ["frontier08998", "frontier08999", "frontier09000", "frontier09001"]),
        ("gpu[9-11],login1", ["gpu9", "gpu10", "gpu11", "login1"]),
        ("r[1-2]-n[01,03]", ["r1-n01", "r1-n03", "r2-n01", "r2-n03"]),
        ("a[1-2]b,c[3]", ["a1b", "a2b", "c3"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_slurm_coordinator_and_ranks():
    p = plan(env=slurm(11, 16, "frontier[00007,00011-00012]", per_node=8))
    assert p["source"] == "slurm"
    assert p["coordinator"] == f"frontier00007:{4100 % 4096 + 61440}"  # JAX's job-id port rule
    assert (p["num_processes"], p["process_id"]) == (16, 11)
    assert p["slurm"]["node"] == "frontier00011" and p["slurm"]["local_id"] == 3
    for port_var in ("XMOE_COORDINATOR_PORT", "JAX_COORDINATOR_PORT"):
        assert plan(env=slurm(0, 2, **{port_var: 3442}))["coordinator"] == "node001:3442"


def test_one_process_per_gcd_bound_by_srun_uses_the_visible_device():
    # srun --gpus-per-task=1 --gpu-bind=closest: task 5 sees one GCD (physical id 7) as device 0;
    # JAX's own SLURM detection would ask for device 5 and fail.
    env = slurm(5, 16, per_node=8, SLURM_GPUS_PER_TASK=1, ROCR_VISIBLE_DEVICES=7)
    p = plan(env=env)
    assert p["local_device_ids"] is None and "bound by srun" in p["devices"]
    # CUDA, binding recognised from the visible count alone
    assert plan(env=slurm(3, 8, CUDA_VISIBLE_DEVICES=3))["local_device_ids"] is None


def test_one_process_per_gpu_sharing_the_node_picks_by_local_id():
    everything = ",".join(map(str, range(8)))
    ids = [plan(env=slurm(i, 16, CUDA_VISIBLE_DEVICES=everything))["local_device_ids"] for i in range(16)]
    assert ids == [[i % 8] for i in range(16)]
    # 4 tasks per node over 8 GPUs: two each, contiguous
    p = plan(env=slurm(6, 8, SLURM_GPUS_ON_NODE=8))
    assert p["local_device_ids"] == [4, 5] and "2 device(s) per task" in p["devices"]
    # nothing known about the GPUs: one per task (JAX's convention)
    assert plan(env=slurm(2, 8))["local_device_ids"] == [2]


def test_one_process_per_node_uses_all_local_devices():
    p = plan(env=slurm(1, 2, per_node=1, CUDA_VISIBLE_DEVICES="0,1,2,3", SLURM_GPUS_ON_NODE=4))
    assert p["local_device_ids"] is None and "one task per node" in p["devices"]
    assert p["slurm"]["node"] == "node002"


def test_batch_script_outside_srun_is_single_process():
    env = slurm(0, 16)
    del env["SLURM_STEP_NODELIST"]  # the batch step: SLURM_NTASKS is set, but there is one process
    assert plan(env=env)["source"] == "single"
    assert plan(env=slurm(0, 1, "node001"))["source"] == "single"  # srun -n1


def test_precedence_arguments_then_environment_then_slurm():
    env = slurm(3, 4, XMOE_COORDINATOR="envhost:1234")
    p = plan(env=env)
    assert p["coordinator"] == "envhost:1234" and p["process_id"] == 3
    p = plan("cli:99", 2, 1, "0,1", env=env)
    assert (p["coordinator"], p["num_processes"], p["process_id"]) == ("cli:99", 2, 1)
    assert p["local_device_ids"] == [0, 1] and p["source"] == "arguments"
    assert plan(env=env, auto=False)["source"] == "single"  # --no-distributed
    env_only = {"XMOE_COORDINATOR": "h:1", "XMOE_NUM_PROCESSES": "2", "XMOE_PROCESS_ID": "1"}
    assert plan(env=env_only)["source"] == "environment"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_processes": 2, "process_id": 0}, "no coordinator; pass --coordinator"),
        ({"num_processes": 2, "coordinator": "h:1"}, "no process id"),
        ({"num_processes": 2, "process_id": 2, "coordinator": "h:1"}, r"must be in \[0, 1\]"),
        ({"num_processes": 2, "process_id": 0, "coordinator": "hostonly"}, "HOST:PORT"),
        ({"num_processes": 2, "process_id": 0, "coordinator": "h:99999"}, "port"),
        ({"num_processes": 2, "process_id": 0, "coordinator": "h:1", "local_device_ids": "0,x"}, "integer"),
        ({"num_processes": 0}, ">= 1"),
        ({"timeout_s": 0}, "init timeout"),
    ],
)
def test_bad_launch_settings_name_the_fix(kwargs, match):
    with pytest.raises(DistributedError, match=match):
        plan(env={}, **kwargs)


def test_single_process_initialize_is_a_no_op():
    p = distributed.initialize(timeout_s=5, auto=False)
    assert not p.is_multi_process and not jax.distributed.is_initialized()


def test_initialize_after_jax_started_is_refused():
    jax.devices()  # this test process already runs a backend
    with pytest.raises(DistributedError, match="before anything that touches devices"):
        distributed.initialize("127.0.0.1:1", 2, 1, timeout_s=1, auto=False)


def test_no_distributed_flag_conflicts_with_explicit_launch():
    ap = argparse.ArgumentParser()
    cli.add_cli_flags(ap)
    with pytest.raises(DistributedError, match="conflicts"):
        cli.initialize_from_args(ap.parse_args(["--no-distributed", "--num-processes", "2"]))


@pytest.mark.parametrize(
    "mesh, numbers",
    [
        (["mesh.data=2", "mesh.expert=8"], ("16", "8 devices")),
        (["mesh.data=-1", "mesh.expert=8", "mesh.tensor=2"], ("16", "8 devices")),
        (["mesh.data=1", "mesh.expert=4"], ("4", "8 devices")),
    ],
)
def test_device_count_mismatch_names_both_sizes(mesh, numbers):
    cfg = load_config(REPO / "configs" / "tiny.yaml", mesh)
    with pytest.raises(ConfigError) as err:
        cfg.validate_for_devices(8, num_processes=2)
    assert all(n in str(err.value) for n in numbers), str(err.value)


def test_data_position_restarts_when_the_process_count_changes(tmp_path, caplog):
    """A checkpoint written by 2 processes restored by 1: state restored, data from step N."""
    cfg = load_config(REPO / "configs" / "tiny.yaml")

    def stream():
        return make_input(DataConfig(seed=3), seq_len=8, batch_size=2, vocab_size=256)

    it = stream()
    for _ in range(5):
        next(it)
    state = {"w": jax.numpy.arange(4.0)}
    with Checkpointer(tmp_path, cfg.checkpoint) as ckpt:
        ckpt.save(5, state, it, cfg, force=True)
    data_dir = tmp_path / "5" / "data"
    (data_dir / "process_0-of-1.json").rename(data_dir / "process_0-of-2.json")
    (data_dir / "process_0-of-2.json").with_name("process_1-of-2.json").write_text('{"next_index": 5}')
    ref = stream()
    for _ in range(5):
        next(ref)
    expected = next(ref)["inputs"]

    fresh = stream()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with Checkpointer(tmp_path, cfg.checkpoint) as ckpt, caplog.at_level(logging.WARNING, "xmoe_jax"):
        assert ckpt.data_process_count(5) == 2
        restored = ckpt.restore(abstract, fresh, 5)
    assert (restored["w"] == state["w"]).all()
    assert (next(fresh)["inputs"] == expected).all()  # stream position = step, this layout
    assert "written by 2 process(es), this run has 1" in caplog.text


# ----------------------------------------------------------------------------- launch scripts


@pytest.mark.parametrize("script", ["slurm_frontier.sh", "slurm_cuda.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def _dry_run(script: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XMOE_"))}
    out = subprocess.run(
        ["bash", str(SCRIPTS / script), "--config", "configs/tiny.yaml"],
        env={**clean, "DRY_RUN": "1", "PYTHON": sys.executable, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_frontier_dry_run_prints_the_plan():
    out = _dry_run("slurm_frontier.sh", NODES="2")
    assert "+ module load rocm/7.2.0" in out and "+ module load rccl-net-plugin" in out
    assert "--gpus-per-task=1 --gpu-bind=closest" in out and "-n 16" in out
    assert "NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3" in out and "FI_CXI_RDZV_PROTO=alt_read" in out
    assert "launch plan: 16 process(es), source slurm, coordinator frontier00001:" in out
    lines = [line for line in out.splitlines() if line.strip().startswith("process")]
    assert len(lines) == 16 and "node frontier00002 (local 7)" in lines[-1]
    assert all("bound by srun" in line for line in lines)
    manual = _dry_run("slurm_frontier.sh", XMOE_RCCL_PLUGIN="/sw/librccl-net.so", NCCL_NET_GDR_LEVEL="3")
    assert "NCCL_NET_PLUGIN=/sw/librccl-net.so" in manual and "FI_MR_CACHE_MONITOR=kdreg2" in manual
    assert "NCCL_NET_GDR_LEVEL=3" in manual  # a value exported before sbatch wins
    per_node = _dry_run("slurm_frontier.sh", NODES="3", MODE="per-node")
    assert "launch plan: 3 process(es)" in per_node and "one task per node" in per_node


def test_cuda_dry_run_per_gpu_and_per_node():
    out = _dry_run("slurm_cuda.sh", NODES="2", GPUS_PER_NODE="4")
    assert "srun -N 2 --ntasks-per-node=4 --gpus-per-task=1" in out
    assert "launch plan: 8 process(es)" in out and "coordinator gpu001:" in out
    out = _dry_run("slurm_cuda.sh", NODES="2", MODE="per-node")
    assert "launch plan: 2 process(es)" in out and "one task per node: all local devices" in out


def test_plan_module_prints_this_process():
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XMOE_"))}
    env = {**clean, **slurm(9, 16, per_node=8, SLURM_GPUS_PER_TASK=1, ROCR_VISIBLE_DEVICES=2)}
    out = subprocess.run(
        [sys.executable, "-m", "xmoe_jax.launch.distributed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "process    9/16  node node002 (local 1)" in out.stdout


def test_shutdown_drops_the_backends_before_leaving_jax_distributed(monkeypatch):
    """JAX's own exit order (clear the backends, then leave): a GPU client outliving
    `jax.distributed.shutdown()` polled the stopped coordination service (`WatchTasksAsync failed
    ... Connection refused` at the end of every multi-process GPU run)."""
    from jax._src import api, xla_bridge

    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    monkeypatch.setattr(api, "clear_backends", lambda *a, **k: calls.append("clear_backends"))
    monkeypatch.setattr(jax.distributed, "shutdown", lambda: calls.append("jax.distributed.shutdown"))
    distributed.shutdown()
    assert calls == ["clear_backends", "jax.distributed.shutdown"]


def test_shutdown_is_a_no_op_for_one_process(monkeypatch):
    from jax._src import api

    monkeypatch.setattr(api, "clear_backends", lambda *a, **k: pytest.fail("cleared one process's backends"))
    distributed.shutdown()  # jax.distributed is not initialised in this process
    assert jax.devices()  # the backend is still there


def test_local_launch_gives_each_process_the_launch_flags():
    from xmoe_jax.launch import local

    argv = local.process_argv(["python3", "x.py", "--steps", "3"], 2, 4, 1234, one_device_each=True)
    assert argv == ["python3", "x.py", "--steps", "3", "--coordinator", "127.0.0.1:1234",
                    "--num-processes", "4", "--process-id", "2", "--local-device-ids", "2"]  # fmt: skip
    assert "--local-device-ids" not in local.process_argv(["x"], 0, 2, 1, one_device_each=False)


def test_local_compare_says_whether_losses_are_bitwise_equal():
    from xmoe_jax.launch import local

    single = {"tokens_per_s": 100.0, "losses": [5.5, 5.25, 5.0], "num_processes": 1}
    same = local.compare_runs(single, {"tokens_per_s": 98.0, "losses": [5.5, 5.25, 5.0], "num_processes": 4})
    assert same["losses_bitwise_equal"] and same["ratio"] == pytest.approx(0.98)
    assert same["first_differing_step"] is None and same["max_abs_loss_diff"] == 0
    off = local.compare_runs(single, {"tokens_per_s": 98.0, "losses": [5.5, 5.25 + 2**-20, 5.0]})
    assert not off["losses_bitwise_equal"] and off["first_differing_step"] == 2
    assert not local.compare_runs(single, {"tokens_per_s": 1.0, "losses": [5.5]})["losses_bitwise_equal"]
    noisy = "I ok\nW pjrt_client.cc] WatchTasksAsync failed for task 1: UNAVAILABLE: Connection refused\n"
    assert len(local.noise_lines(noisy)) == 1
