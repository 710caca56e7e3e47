"""Our warp-specialized Mosaic-GPU grouped GEMM (xmoe_jax/kernels/gmm/mgpu_ws.py) and its backend, on CPU.

The kernel itself needs a Hopper GPU: scripts/bench_gmm_ws.py checks it there against float32 XLA (skewed
groups, empty groups, rows past the sum, a partial last tile) before it times it
(benchmarks/kernels.md). Here: its work list against NumPy, its lowering to Mosaic GPU for CUDA
(`jax.export`, which catches tracing and lowering errors before a GPU is involved), its refusals, and
the defaults that send contiguous gmm calls to it on CUDA and row-indexed ones to pallas; the same for
its weight gradient (gmm/mgpu_ws_tgmm.py, `bench_gmm_ws.py --op tgmm` on the GPU).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xmoe_jax.kernels import backends, defaults
from xmoe_jax.kernels.gmm import mgpu_ws, mgpu_ws_tgmm


@pytest.mark.parametrize("sizes", [[5, 0, 300, 0, 9, 256, 1], [0, 0, 0], [512, 0]])
def test_work_items_cover_each_grouped_row_once_within_its_group_and_tile(sizes):
    rows, cta_m = 1100, 256
    gs = np.asarray(sizes, np.int32)
    meta = np.asarray(mgpu_ws.work_items(jnp.asarray(gs), rows, cta_m))
    group, tile, lo, count = meta
    ends = np.cumsum(gs)
    starts = ends - gs
    covered = np.zeros(rows, np.int32)
    for g, t, a, n in zip(group, tile, lo, count, strict=True):
        if n == 0:
            continue
        assert starts[g] <= a and a + n <= ends[g], "rows outside the item's group"
        assert t * cta_m <= a and a + n <= (t + 1) * cta_m, "rows outside the item's tile"
        covered[a : a + n] += 1
    np.testing.assert_array_equal(covered[: gs.sum()], 1)  # every grouped row, once
    assert not covered[gs.sum() :].any()  # rows past the sum: never computed or stored
    assert meta.shape[1] == -(-rows // cta_m) + len(sizes) - 1  # gmm's static bound (metadata.py)


@pytest.mark.parametrize("k_dim, n_dim, transpose", [(256, 128, False), (128, 256, False), (128, 256, True)])
def test_the_kernel_lowers_to_mosaic_gpu_for_cuda(k_dim, n_dim, transpose):
    """The default configs (defaults.WS_CONFIGS: 256 x 128 and 128 x 256 CTAs), forward and transposed."""
    config = defaults.ws_config(n_dim)
    experts, rows = 4, 1024
    w_shape = (experts, n_dim, k_dim) if transpose else (experts, k_dim, n_dim)

    def f(x, w, gs):
        return mgpu_ws.gmm_ws(x, w, gs, config=config, transpose_rhs=transpose)

    args = (
        jax.ShapeDtypeStruct((rows, k_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct(w_shape, jnp.bfloat16),
        jax.ShapeDtypeStruct((experts,), jnp.int32),
    )
    text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text and "xmoe_gmm_ws" in text


def test_the_push_epilogue_lowers_to_mosaic_gpu_for_cuda():
    """gmm_push's kernel (the down-projection's epilogue storing rows on 4 peers, then the semaphore
    count) through jax.export for CUDA on this CPU: [out_rows, N] per device, the rows behind a barrier
    (kernels/push/mgpu.py says why)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    peers, local, rows, out_rows = 4, 4, 768, 1024
    mesh = jax.make_mesh((peers,), ("expert",), axis_types=(AxisType.Explicit,))
    spec = PartitionSpec("expert")
    push = mgpu_ws.PushSpec("expert", peers, local, out_rows)

    def body(h, w, gs, seg):
        y = mgpu_ws.gmm_ws(h, w, gs[0], config=defaults.ws_config(2048), push=push, seg_3X=seg[0])
        assert y.shape == (out_rows, 2048)
        return y

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False))
    on = NamedSharding(mesh, spec)
    args = (
        jax.ShapeDtypeStruct((peers * rows, 1408), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((peers * local, 1408, 2048), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((peers, local), jnp.int32, sharding=on),
        jax.ShapeDtypeStruct((peers, 3, peers * local), jnp.int32, sharding=on),
    )
    text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text and "xmoe_gmm_ws_push" in text
    with pytest.raises(ValueError, match="seg_3X"):
        mgpu_ws.gmm_ws(
            jnp.zeros((256, 64), jnp.bfloat16),
            jnp.zeros((2, 64, 256), jnp.bfloat16),
            jnp.asarray([9, 9]),
            push=push,
        )


@pytest.mark.parametrize("transpose", [False, True], ids=["up", "ddown"])
def test_the_arrive_prologue_lowers_to_mosaic_gpu_for_cuda(transpose):
    """push_gmm's kernel (copying CTAs pushing group-major to 4 peers and signalling per group, the GEMM
    waiting per group on what lands) through jax.export for CUDA on this CPU, for the dispatch's
    up-projection and the cotangent's d act (rhs transposed): (received [M, D], GEMM [M, F]) per device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    peers, local, send, recv, dim, hidden = 4, 4, 768, 1024, 2048, 1408
    mesh = jax.make_mesh((peers,), ("expert",), axis_types=(AxisType.Explicit,))
    spec = PartitionSpec("expert")
    arrive = mgpu_ws.ArriveSpec("expert", peers, local, recv)

    def body(x, w, gs, plan):
        r, y = mgpu_ws.arrive_gmm_ws(
            x, plan[0], w, gs[0], arrive=arrive, config=defaults.ws_config(hidden), transpose_rhs=transpose
        )
        assert r.shape == (recv, dim) and y.shape == (recv, hidden)
        return r, y

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec), check_vma=False)
    )
    on = NamedSharding(mesh, spec)
    w_shape = (peers * local, hidden, dim) if transpose else (peers * local, dim, hidden)
    args = (
        jax.ShapeDtypeStruct((peers * send, dim), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct(w_shape, jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((peers, local), jnp.int32, sharding=on),
        jax.ShapeDtypeStruct((peers, 3, peers * local), jnp.int32, sharding=on),
    )
    text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text and "xmoe_arrive_gmm_ws" in text
    with pytest.raises(ValueError, match="push_ctas"):
        mgpu_ws.arrive_gmm_ws(
            jnp.zeros((256, 64), jnp.bfloat16),
            jnp.zeros((3, 8), jnp.int32),
            jnp.zeros((2, 64, 256), jnp.bfloat16),
            jnp.asarray([9, 9]),
            arrive=mgpu_ws.ArriveSpec("expert", 4, 2, 256, push_ctas=0),
        )
    with pytest.raises(ValueError, match="push_stages=1 must be at least 2"):
        mgpu_ws.arrive_gmm_ws(
            jnp.zeros((256, 64), jnp.bfloat16),
            jnp.zeros((3, 8), jnp.int32),
            jnp.zeros((2, 64, 256), jnp.bfloat16),
            jnp.asarray([9, 9]),
            arrive=mgpu_ws.ArriveSpec("expert", 4, 2, 256, push_stages=1),
        )


def test_shapes_it_cannot_take_are_refused_before_tracing():
    cfg = defaults.ws_config(1408)
    bf16 = jnp.bfloat16
    assert mgpu_ws.shape_reason(bf16, 2048, 1408, cfg, 98_304) is None
    assert "multiple of 8" in mgpu_ws.shape_reason(bf16, 2048, 1408, cfg, 98_227)
    assert "one 256-row tile" in mgpu_ws.shape_reason(bf16, 2048, 1408, cfg, 128)
    assert "tile_k" in mgpu_ws.shape_reason(bf16, 2000, 1408, cfg)
    assert "columns" in mgpu_ws.shape_reason(bf16, 2048, 1400, cfg)
    assert "bfloat16" in mgpu_ws.shape_reason(jnp.float32, 2048, 1408, cfg)
    narrow = mgpu_ws.WsConfig(128, 128, 64, 4, "m", epi_n=32)  # faulted on an H200 (misaligned stores)
    assert "epi_n" in mgpu_ws.shape_reason(bf16, 2048, 1408, narrow)
    with pytest.raises(ValueError, match="gmm_ws: .*multiple of 8"):
        mgpu_ws.gmm_ws(jnp.zeros((100, 64), bf16), jnp.zeros((2, 64, 128), bf16), jnp.asarray([50, 50]))


def test_cuda_sends_contiguous_gmm_to_ws_and_indexed_gmm_to_pallas(monkeypatch):
    monkeypatch.setattr(defaults, "platform", lambda: "cuda")
    monkeypatch.delenv("XMOE_KERNELS", raising=False)
    assert defaults.default_implementation("gmm") == "pallas"  # a CUDA target with no Hopper to ask: no ws
    monkeypatch.setattr(defaults, "is_hopper", lambda: True)
    assert defaults.default_implementation("gmm") == "ws"
    assert defaults.default_implementation("gmm_indexed") == "pallas"
    assert defaults.default_implementation("tgmm") == "ws"
    assert defaults.default_implementation("tgmm_indexed") == "pallas"
    ws = backends.IMPLEMENTATIONS["ws"]
    x = jax.ShapeDtypeStruct((98_304, 2048), jnp.bfloat16)
    indexed = backends.Call("gmm", (x,), 2048, 1408, indexed=True)
    assert "pallas gathers on load" in ws.shape_reason(indexed)
    tiled = backends.Call("gmm", (x,), 2048, 1408, tile=(128, 64, 128))
    assert "own configs" in ws.shape_reason(tiled)
    assert ws.shape_reason(backends.Call("gmm", (x,), 2048, 1408)) is None
    assert ws.ops == frozenset({"gmm", "tgmm"})  # permute and FP8 run on its fallback, pallas
    # tgmm: the up-projection's dW [2048, 1408] takes the M split; the down-projection's [1408, 2048] stays
    # on pallas (measured slower split along N: defaults.WS_TGMM_CONFIGS)
    dw = jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16)
    assert ws.shape_reason(backends.Call("tgmm", (x, x, dw), 2048, 1408)) is None
    assert "not whole 256 x 128" in ws.shape_reason(backends.Call("tgmm", (x, x, dw), 1408, 2048))
    indexed = backends.Call("tgmm", (x, x, dw), 2048, 1408, indexed=True)
    assert "pallas gathers on load" in ws.shape_reason(indexed)
    dw_f32 = jax.ShapeDtypeStruct((64, 2048, 1408), jnp.float32)
    assert "16-bit gradients" in ws.shape_reason(backends.Call("tgmm", (x, x, dw_f32), 2048, 1408))


def test_xmoe_kernels_names_one_backend_for_every_op_or_one_per_op(monkeypatch):
    """XMOE_KERNELS=pallas moves every op; XMOE_KERNELS=tgmm=ws,permute=xla only the ops it names (the GPU
    batches' A/B runs); anything else is refused naming both forms, and an unknown backend by its name."""
    monkeypatch.setattr(defaults, "platform", lambda: "cpu")
    monkeypatch.setenv("XMOE_KERNELS", "pallas")
    assert defaults.default_implementation("gmm") == defaults.default_implementation("tgmm") == "pallas"
    monkeypatch.setenv("XMOE_KERNELS", "tgmm=ws,permute=pallas")
    assert defaults.default_implementation("tgmm") == "ws"
    assert defaults.default_implementation("permute") == "pallas"
    assert defaults.default_implementation("gmm") == "xla"  # the table's
    monkeypatch.setenv("XMOE_KERNELS", "tgmm=ws,pallas")
    with pytest.raises(ValueError, match="op=backend pairs"):
        defaults.default_implementation("gmm")
    monkeypatch.setenv("XMOE_KERNELS", "tgmm=fast")
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    with pytest.raises(ValueError, match="'fast'"):
        backends.choose_backend(None, backends.Call("tgmm", (x,), 32, 32))


@pytest.mark.parametrize("sizes", [[5, 0, 300, 0, 9, 256, 1], [0, 0, 0], [64, 64, 0, 1]])
def test_tgmm_blocks_cover_each_group_and_mask_only_its_neighbours(sizes):
    """mgpu_ws_tgmm.group_blocks: a group's blocks of tile_k rows start at its start rounded down, cover
    its rows, and the masks (rows before `head` in the first block, after `last` in the last) leave
    exactly the group's rows."""
    tile_k = 64
    gs = np.asarray(sizes, np.int32)
    first, blocks, head, last = np.asarray(mgpu_ws_tgmm.group_blocks(jnp.asarray(gs), tile_k))
    ends = np.cumsum(gs)
    for e, size in enumerate(gs):
        if size == 0:
            assert blocks[e] == 0
            continue
        assert first[e] % tile_k == 0
        kept = []
        for k in range(blocks[e]):
            rows = first[e] + k * tile_k + np.arange(tile_k)
            keep = np.ones(tile_k, bool)
            if k == 0:
                keep &= np.arange(tile_k) >= head[e]
            if k == blocks[e] - 1:
                keep &= np.arange(tile_k) <= last[e]
            kept.extend(rows[keep])
        np.testing.assert_array_equal(kept, np.arange(ends[e] - size, ends[e]))


@pytest.mark.parametrize("m_dim, n_dim", [(256, 128), (512, 256)])
def test_the_tgmm_kernel_lowers_to_mosaic_gpu_for_cuda(m_dim, n_dim):
    """The ws tgmm (the default config, split along M) through jax.export for CUDA on this CPU."""
    config = defaults.ws_tgmm_config(m_dim, n_dim)

    def f(x, g, gs):
        return mgpu_ws_tgmm.tgmm_ws(x, g, gs, config=config)

    args = (
        jax.ShapeDtypeStruct((1000, m_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1000, n_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text and "xmoe_tgmm_ws" in text


def test_tgmm_shapes_it_cannot_take_are_refused_before_tracing():
    cfg = defaults.ws_tgmm_config(2048, 1408)
    bf16 = jnp.bfloat16
    assert mgpu_ws_tgmm.shape_reason(bf16, 2048, 1408, 393_216, cfg) is None
    assert "multiple of 8" in mgpu_ws_tgmm.shape_reason(bf16, 2048, 1408, 1001, cfg)
    assert "CTA tiles" in mgpu_ws_tgmm.shape_reason(bf16, 1408, 2048, 1000, cfg)
    assert "bfloat16" in mgpu_ws_tgmm.shape_reason(jnp.float32, 2048, 1408, 1000, cfg)
    in_flight = mgpu_ws.WsConfig(128, 128, 64, 4, "m", in_flight=1)  # faulted on an H200 (docstring)
    assert "in_flight" in mgpu_ws_tgmm.shape_reason(bf16, 2048, 1408, 1000, in_flight)
    with pytest.raises(ValueError, match="tgmm_ws: .*multiple of 8"):
        mgpu_ws_tgmm.tgmm_ws(
            jnp.zeros((100, 256), bf16), jnp.zeros((100, 128), bf16), jnp.asarray([50, 50]), config=cfg
        )


@pytest.mark.parametrize("op", ["gmm", "tgmm"])
def test_the_benchmark_runs_tiny_on_cpu(op, tmp_path):
    """scripts/bench_gmm_ws.py --tiny (and --op tgmm): the references and peers it times on any machine
    (the kernel's rows say it needs a Hopper GPU), one JSON row each, and its table."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "ws.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "scripts/bench_gmm_ws.py",
        "--tiny",
        "--iters",
        "1",
        "--no-torch",
        "--out",
        str(out),
    ]
    proc = subprocess.run([*cmd, "--op", op], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| case / pass | variant |" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert not [r for r in rows if "error" in r], rows
    timed = {(r["case"], r["pass_"], r["variant"]) for r in rows if "ms" in r}
    cases, passes = (
        (("ep1",), ("up_wgrad", "down_wgrad"))
        if op == "tgmm"
        else (("ep1", "ep4"), ("up_fwd", "down_fwd", "up_dgrad"))
    )
    for case in cases:
        for pass_ in passes:
            assert {(case, pass_, "dense_same_flops"), (case, pass_, "default_xla")} <= timed
