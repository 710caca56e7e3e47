"""The push exchange kernel (xmoe_jax/kernels/push): its reference, its Mosaic-GPU lowering, its refusals.

The kernel itself writes into other GPUs' memory, which no CPU can run (JAX's GPU interpret mode has no
remote refs or semaphores): on CPU its plan runs through the XLA reference, which tests/test_exchange.py
and the oracle suite (tests/test_dispatch_oracle.py, `push` layouts) check against NumPy and the dense
oracle; scripts/bench_exchange.py checks the kernel bit for bit against NumPy on GPUs. Here: the
reference with several updates per peer, and the kernel lowered to Mosaic GPU for CUDA on this CPU
(`jax.export`), which catches every tracing and lowering error before a GPU is involved.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from xmoe_jax.kernels import platform
from xmoe_jax.kernels.push import mgpu, push_rows

PEERS, N, M, D, U = 4, 24, 30, 16, 3
AXIS = "expert"


def _mesh():
    return jax.make_mesh((1, PEERS), ("data", AXIS), axis_types=(AxisType.Explicit,) * 2)


def _on_axis(body, mesh):
    """jit(shard_map(body)) with both operands and the result split over the exchange axis."""
    spec = PartitionSpec(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False))


def _abstract(mesh, *shapes):
    """Abstract operands (shape, dtype) split over the exchange axis: lowered and compiled, never run."""
    on_axis = NamedSharding(mesh, PartitionSpec(AXIS))
    return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=on_axis) for shape, dtype in shapes)


def _meta(rng):
    """Per device U updates per peer, each a random (src, size, dst) that keeps inside the buffers."""
    size = rng.integers(0, 3, (PEERS, PEERS * U)).astype(np.int32)
    size[1] = 0  # device 1 sends nothing
    src = np.zeros_like(size)
    dst = np.zeros_like(size)
    for s in range(PEERS):
        src[s] = np.cumsum(size[s]) - size[s] + rng.integers(0, 2)  # a gap at the front
    for d in range(PEERS):
        pos = 0
        for s in range(PEERS):  # receivers stack what each source's U updates bring them
            for u in range(U):
                x = d * U + u
                dst[s, x] = pos
                pos += size[s, x]
    return np.stack([src, size, dst], axis=1)  # [device, 3, X]


def test_reference_puts_every_update_where_its_plan_says():
    rng = np.random.default_rng(0)
    meta = _meta(rng)
    x = rng.standard_normal((PEERS, N, D)).astype(np.float32)
    mesh = _mesh()
    on_axis = NamedSharding(mesh, PartitionSpec(AXIS))
    fn = jax.jit(
        jax.shard_map(
            lambda x, m: push_rows(x, m[0], out_rows=M, axis_name=AXIS, num_peers=PEERS, max_piece=2),
            mesh=mesh,
            in_specs=(PartitionSpec(AXIS), PartitionSpec(AXIS)),
            out_specs=PartitionSpec(AXIS),
        )
    )
    got = np.asarray(fn(jax.device_put(x.reshape(-1, D), on_axis), jax.device_put(meta, on_axis))).reshape(
        PEERS, M, D
    )
    want = np.zeros_like(got)
    for s in range(PEERS):
        for xi in range(PEERS * U):
            src, size, dst = meta[s, :, xi]
            want[xi // U, dst : dst + size] = x[s, src : src + size]
    np.testing.assert_array_equal(got, want)


def test_kernel_lowers_to_mosaic_gpu_for_cuda_on_this_cpu():
    mesh = _mesh()

    def body(x, m):
        return mgpu.push_rows(x, m[0], out_rows=600, axis_name=AXIS, num_peers=PEERS, num_ctas=8)

    exported = jax.export.export(_on_axis(body, mesh), platforms=["cuda"])(
        *_abstract(mesh, ((PEERS * 512, 2048), jnp.bfloat16), ((PEERS, 3, PEERS * 2), jnp.int32))
    )
    module = exported.mlir_module()
    assert "mosaic_gpu" in module
    # the rows leave through a barrier, so XLA:GPU's dynamic-slice fusion cannot clone the kernel into
    # a store (test_the_kernel_runs_once_per_call_when_a_scan_stacks_its_rows, on GPUs)
    calls = re.findall(r"(%\w+):2 = stablehlo.custom_call @mosaic_gpu_v2", module)
    assert calls and all(re.search(rf"stablehlo.optimization_barrier {c}#0", module) for c in calls), calls


def test_rows_that_bulk_copies_cannot_move_are_refused_by_name():
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        mgpu.push_rows(
            jnp.zeros((8, 3), jnp.bfloat16),
            jnp.zeros((3, 4), jnp.int32),
            out_rows=8,
            axis_name=AXIS,
            num_peers=4,
        )


def test_block_rows_are_a_power_of_two_within_the_block_bytes():
    assert mgpu.block_rows(4096) == 8  # 2048 bf16: 8 rows of 4 KiB in 32 KiB
    assert mgpu.block_rows(3000) == 8
    assert mgpu.block_rows(1 << 20) == 1  # a row wider than a block still moves, one at a time


def test_platforms_without_the_kernel_are_refused_naming_the_fallback():
    with platform.target("rocm"), pytest.raises(ValueError, match="parallel.transport=bucketed"):
        push_rows(
            jnp.zeros((8, 16)),
            jnp.zeros((3, 4), jnp.int32),
            out_rows=8,
            axis_name=AXIS,
            num_peers=4,
            max_piece=2,
        )


@pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.device_count() < 2 or not platform.is_hopper(),
    reason="compiles the Mosaic kernel for 2+ Hopper GPUs",
)
def test_the_kernel_runs_once_per_call_when_a_scan_stacks_its_rows():
    """A scan that stacks the pushed rows (as the layer scan stacks a saved residual) and also reads
    them: XLA:GPU's dynamic-slice fusion cloned the kernel into the stack's store, so each exchange
    ran twice (found at 28 layers on 4x H200). One kernel per call in the compiled program."""
    peers = jax.device_count()
    mesh = jax.make_mesh((peers,), (AXIS,), axis_types=(AxisType.Explicit,))
    rows = 64

    def step(x, m):
        def body(carry, _):
            y = mgpu.push_rows(carry, m[0], out_rows=rows, axis_name=AXIS, num_peers=peers, num_ctas=4)
            return carry + y, y  # y read by the carry and stacked by the scan

        return jax.lax.scan(body, x, None, length=3)

    args = _abstract(mesh, ((peers * rows, 128), jnp.bfloat16), ((peers, 3, peers), jnp.int32))
    compiled = _on_axis(step, mesh).lower(*args).compile().as_text()  # compiled only, never run
    assert compiled.count('custom_call_target="mosaic_gpu_v2"') == 1


def test_the_fused_return_benchmark_runs_tiny_on_cpu(tmp_path):
    """scripts/bench_gmm_push.py --tiny on 2 fake CPU devices, both passes (the down-projection and the
    transposed data gradient): the fused path's reference equals the GEMM-then-push reference bit for bit
    on the rows sent, within bf16 of float32 (the GPU run checks the Mosaic kernels the same way first)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "gmm_push.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    cmd = [sys.executable, "scripts/bench_gmm_push.py", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = [r for r in json.loads(out.read_text())["results"] if r["kind"] == "check"]
    assert {(r["pass_"], r["case"]) for r in checks} == {
        (p, c) for p in ("down", "dgrad") for c in ("uniform", "skewed")
    }
    assert all(r["fused_equals_serial"] and r["rel_err_fused"] < 1e-2 for r in checks), checks


def test_the_copying_ctas_of_push_gmm_come_from_the_env_or_16(monkeypatch):
    from xmoe_jax.kernels.push import api

    monkeypatch.delenv(api.ARRIVE_CTAS_ENV, raising=False)
    assert api.arrive_ctas() == 16
    monkeypatch.setenv(api.ARRIVE_CTAS_ENV, "32")
    assert api.arrive_ctas() == 32
    monkeypatch.setenv(api.ARRIVE_CTAS_ENV, "0")
    with pytest.raises(ValueError, match="XMOE_ARRIVE_CTAS='0': use a positive number"):
        api.arrive_ctas()


def test_the_gemm_and_its_exchange_fuse_only_where_ws_takes_the_call(monkeypatch):
    """gmm_push and push_gmm run one kernel only where the contiguous gmm runs on ws and ws takes the
    shapes; otherwise the GEMM and the push kernel run one after the other."""
    from xmoe_jax.kernels import defaults
    from xmoe_jax.kernels.push import api

    rhs = jnp.zeros((4, 2048, 1408), jnp.bfloat16)
    lhs = jnp.zeros((1024, 2048), jnp.bfloat16)
    _, config = api._ws_plan("push_gmm", rhs, jnp.zeros((3, 16), jnp.int32), 4, False)
    monkeypatch.setattr(defaults, "default_implementation", lambda op: "ws")
    assert api._fused("mgpu", lhs, rhs, config, 1024, False)
    assert not api._fused("xla", lhs, rhs, config, 1024, False)
    assert not api._fused("mgpu", lhs.astype(jnp.float32), rhs, config, 1024, False)
    assert not api._fused("mgpu", lhs, rhs, config, 1020, False)  # ws takes multiples of 8 rows
    monkeypatch.setattr(defaults, "default_implementation", lambda op: "pallas")
    assert not api._fused("mgpu", lhs, rhs, config, 1024, False)
    with pytest.raises(ValueError, match="push_gmm: meta_3X has 12 updates, not 4 peers x 4 groups"):
        api._ws_plan("push_gmm", rhs, jnp.zeros((3, 12), jnp.int32), 4, False)
