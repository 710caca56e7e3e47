"""The exchange overlapped with compute (`parallel.overlap`, moe/overlap.py) on 8 fake CPU devices
(pft: data 2 x expert 4; rbd: 2 nodes x 2): values and gradients equal the non-overlapped block,
the program order is the pipelined one, the compiled order, the config checks, the XLA scheduler
flags, and the trace reader that says whether NCCL kernels ran under GEMMs.

On CPU collectives are synchronous: these tests show correctness and order, not overlap.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from reference import rel_err

from xmoe_jax.cli import train_main
from xmoe_jax.config import ConfigError, MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.launch import xla_flags
from xmoe_jax.moe import init_moe_params, moe_layer, overlap
from xmoe_jax.moe.stages import run
from xmoe_jax.perf import kernel_overlap
from xmoe_jax.perf.hlo import scheduled_ops
from xmoe_jax.sharding import make_mesh

D, T = 16, 128
CFG = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=1, shared_expert_gate=True)
MESHES = {"pft": MeshConfig(data=2, expert=4), "rbd": MeshConfig(data=2, expert=4, expert_nodes=2)}


def _inputs():
    params = init_moe_params(jax.random.key(0), D, CFG, std=0.3)
    return params, jax.random.normal(jax.random.key(1), (T, D))


def _loss_fn(dispatch: str, mode: str, chunks: int):
    par = ParallelConfig(dispatch=dispatch, overlap=mode, overlap_chunks=chunks)
    mesh = make_mesh(MESHES[dispatch])

    def loss(p, x):
        y, stats = moe_layer(p, x, CFG, par, mesh=mesh)
        return jnp.sum(y * jnp.sin(x)) + stats.aux_loss, (y, stats.num_overflow)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@functools.cache
def _compiled(dispatch: str, mode: str, chunks: int):
    """The layer's loss and gradients, compiled once per case (values and HLO from one compile)."""
    return jax.jit(_loss_fn(dispatch, mode, chunks)).lower(*_inputs()).compile()


def _assert_same(case, baseline):
    (loss, (y, overflow)), grads = _compiled(*case)(*_inputs())
    (loss_b, (y_b, _)), grads_b = _compiled(*baseline)(*_inputs())
    assert int(overflow.sum()) == 0
    assert abs(float(loss) - float(loss_b)) <= 1e-6 * abs(float(loss_b))
    assert rel_err(y, y_b) < 1e-6
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_b), strict=True):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("dispatch", ["pft", "rbd"])
def test_overlap_both_equals_the_sequential_block(dispatch):
    """Shared experts inside the block and pipelined chunks: the same loss, outputs and gradients."""
    _assert_same((dispatch, "both", 2), (dispatch, "none", 2))


@pytest.mark.slow  # ~40 s: each option alone (`both` above covers the two together)
@pytest.mark.parametrize("dispatch", ["pft", "rbd"])
def test_each_overlap_option_equals_the_sequential_block(dispatch):
    _assert_same((dispatch, "shared", 1), (dispatch, "none", 1))
    _assert_same((dispatch, "chunks", 2), (dispatch, "none", 2))


@pytest.mark.slow  # ~1-2 min: two train steps of the tiny model compiled (rbd passed too: 140 s)
@pytest.mark.parametrize("dispatch", ["pft"])
def test_train_step_with_overlap_equals_the_sequential_step(tmp_path, dispatch):
    """configs/tiny.yaml (one shared expert), float32, FSDP (as DeepSeek-V3's config: the shared
    weights enter the block's shard_map gathered): loss and updated parameters of one step."""
    import trainer_parts

    from xmoe_jax.config import load_config

    def step(*over):
        cfg = load_config(
            pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
            [
                f"train.run_dir={tmp_path}",
                "train.batch_size=16",
                "train.seq_len=16",
                "mesh.data=2",
                "mesh.expert=4",
                "mesh.fsdp=true",
                f"mesh.expert_nodes={2 if dispatch == 'rbd' else 1}",
                f"parallel.dispatch={dispatch}",
                "parallel.overlap_chunks=2",
                "checkpoint.enabled=false",
                *over,
            ],
        )
        tokens = jax.random.randint(jax.random.key(0), (16, 16), 0, 256)
        return trainer_parts.one_step(cfg, tokens, tokens)

    state, metrics = step("parallel.overlap=both")
    state_b, metrics_b = step("parallel.overlap=none")
    assert abs(float(metrics["loss"]) - float(metrics_b["loss"])) <= 1e-6 * abs(float(metrics_b["loss"]))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state_b.params), strict=True):
        assert rel_err(a, b) < 1e-6


# ----------------------------------------------------------------------------- order


def _toy(i, names=("send_buffer", "exchange", "experts", "return")):
    for name in names:
        yield name, (i,)
    return f"y{i}"


def test_pipelined_order_on_toy_stages():
    """Lookahead one: dispatch 0, dispatch 1, rest 0, dispatch 2, rest 1, rest 2; results in chunk order.
    rbd's dispatch ends at `stage2/exchange`; a chunk without an exchange (one peer) runs whole."""
    seen = []

    def drive(stages):
        return run(stages, on_stage=seen.append)

    assert drive(overlap.pipelined([_toy(i) for i in range(3)])) == ["y0", "y1", "y2"]
    assert seen == [
        "chunk0/send_buffer", "chunk0/exchange", "chunk1/send_buffer", "chunk1/exchange",
        "chunk0/experts", "chunk0/return", "chunk2/send_buffer", "chunk2/exchange",
        "chunk1/experts", "chunk1/return", "chunk2/experts", "chunk2/return",
    ]  # fmt: skip
    seen.clear()
    rbd = ("pilots", "stage1", "stage2/send_buffer", "stage2/exchange", "stage2/experts", "return")
    drive(overlap.pipelined([_toy(i, rbd) for i in range(2)]))
    assert seen.index("chunk1/stage2/exchange") < seen.index("chunk0/stage2/experts")
    seen.clear()
    assert drive(overlap.pipelined([_toy(i, ("experts",)) for i in range(2)])) == ["y0", "y1"]
    assert seen == ["chunk0/experts", "chunk1/experts"]
    seen.clear()
    assert drive(overlap.sequential([_toy(i) for i in range(2)])) == ["y0", "y1"]
    assert seen == [
        f"chunk{i}/{n}" for i in range(2) for n in ("send_buffer", "exchange", "experts", "return")
    ]


def test_shared_stage_follows_the_first_dispatch_exchange():
    def toy(names):
        yield from ((n, ()) for n in names)
        return 1.0, "stats"

    seen = []
    assert run(
        overlap.with_shared(toy(("pilots", "stage1", "stage2/exchange")), lambda: 2.0), seen.append
    ) == (3.0, "stats")
    assert seen == ["pilots", "stage1", "shared", "stage2/exchange"]
    seen.clear()
    assert run(overlap.with_shared(toy(("send_buffer", "experts")), lambda: 2.0), seen.append) == (
        3.0,
        "stats",
    )
    assert seen == ["send_buffer", "experts", "shared"]  # one peer: no exchange, shared at the end


def _program_order(dispatch: str, mode: str) -> list[str]:
    """The forward's all-to-alls and expert/shared GEMMs in trace order, as `<chunk>/<what>`."""
    par = ParallelConfig(dispatch=dispatch, overlap=mode, overlap_chunks=2)
    mesh = make_mesh(MESHES[dispatch])
    jaxpr = jax.make_jaxpr(lambda p, x: moe_layer(p, x, CFG, par, mesh=mesh)[0])(*_inputs()).jaxpr
    out = []

    def walk(jaxpr, stack):
        for eqn in jaxpr.eqns:
            names = f"{stack}/{eqn.source_info.name_stack}"
            chunk = next((w for w in names.split("/") if w.startswith("chunk")), "-")
            if eqn.primitive.name == "all_to_all":
                out.append(f"{chunk}/a2a")
            elif eqn.primitive.name == "ragged_dot_general" and "experts" in names:
                out.append(f"{chunk}/experts")
            elif eqn.primitive.name == "dot_general" and "shared_experts" in names:
                out.append("shared")
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else [param]:
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr, names)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub, names)

    walk(jaxpr, "")
    squeezed = [op for i, op in enumerate(out) if i == 0 or op != out[i - 1]]  # one entry per run
    return squeezed


def test_pipelined_chunks_dispatch_the_next_chunk_before_the_experts():
    """Program order: chunk 1's dispatch and the shared experts come before chunk 0's expert GEMMs;
    without overlap each chunk runs whole, and the shared experts after the block."""
    assert _program_order("pft", "both") == [
        "chunk0/a2a",  # dispatch 0
        "shared",  # between dispatch and combine, inside the block
        "chunk1/a2a",  # dispatch 1 before chunk 0's experts
        "chunk0/experts",
        "chunk0/a2a",  # combine 0 (can run under chunk 1's experts)
        "chunk1/experts",
        "chunk1/a2a",
    ]
    assert _program_order("pft", "none") == [
        "chunk0/a2a",
        "chunk0/experts",
        "chunk0/a2a",
        "chunk1/a2a",
        "chunk1/experts",
        "chunk1/a2a",
        "shared",
    ]


def test_compiled_schedule_interleaves_the_chunks_exchange_and_experts():
    """The compiled forward (XLA:CPU's schedule): both chunks' dispatch all-to-alls (the rows and
    their routing weights) run before any expert GEMM and both combines after them, and the shared
    experts are inside the block.

    XLA schedules by data flow, not by trace order: on CPU `none` compiles to the same order (the
    chunks are independent either way); on GPU the latency-hiding scheduler decides
    (parallel.xla_scheduler), and this is the order it starts from."""
    text = _compiled("pft", "both", 2).as_text()
    ops = [(k, n) for k, n in scheduled_ops(text) if "transpose(" not in n]  # the forward pass
    a2a = [i for i, (k, _) in enumerate(ops) if k == "all-to-all"]
    experts = [i for i, (k, n) in enumerate(ops) if k == "dot" and "/experts/" in n]
    assert len(a2a) == 6 and experts, ops
    first, last = min(experts), max(experts)
    assert sum(i < first for i in a2a) == 4 and sum(i > last for i in a2a) == 2, ops
    assert any("shard_map" in n and "shared_experts" in n for k, n in ops if k == "dot"), ops


# ----------------------------------------------------------------------------- config, flags


def test_overlap_config_checks_name_the_field_and_fix():
    with pytest.raises(
        ConfigError, match=r"parallel.overlap='chunks'.*overlap_chunks=1; set parallel.overlap_chunks=2"
    ):
        ParallelConfig(dispatch="pft", overlap="chunks")
    with pytest.raises(ConfigError, match=r"parallel.overlap='shared'.*set parallel.dispatch=pft or rbd"):
        ParallelConfig(dispatch="dense", overlap="shared")
    with pytest.raises(ConfigError, match=r"parallel.overlap='all' is not one of"):
        ParallelConfig(dispatch="pft", overlap="all")
    with pytest.raises(ConfigError, match=r"parallel.xla_scheduler='lhs' is not one of"):
        ParallelConfig(xla_scheduler="lhs")
    ParallelConfig(dispatch="rbd", overlap="both", overlap_chunks=2, xla_scheduler="latency_hiding")


def test_cli_rejects_a_bad_overlap_before_anything_starts(capsys):
    assert train_main(["--set", "parallel.dispatch=pft", "--set", "parallel.overlap=chunks"]) == 2
    assert "parallel.overlap_chunks=2" in capsys.readouterr().err


LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"


@pytest.fixture
def _flags(monkeypatch):
    monkeypatch.setattr(xla_flags, "_warned", set())
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: False)
    monkeypatch.delenv("XMOE_XLA_SCHEDULER", raising=False)
    monkeypatch.delenv("XMOE_RAGGED_A2A", raising=False)
    return monkeypatch


def test_latency_hiding_scheduler_is_opt_in_and_the_user_wins(_flags):
    _flags.setenv("XLA_FLAGS", "")
    assert LHS not in xla_flags.apply_defaults()  # default: XLA's own scheduler
    _flags.setenv("XLA_FLAGS", "")
    assert LHS in xla_flags.apply_defaults(scheduler="latency_hiding")
    assert xla_flags.effective_scheduler() == "latency_hiding"
    _flags.setenv("XLA_FLAGS", "")
    _flags.setenv("XMOE_XLA_SCHEDULER", "latency_hiding")  # the scripts' switch
    assert LHS in xla_flags.apply_defaults()
    _flags.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")  # the user's flag stays
    flags = xla_flags.apply_defaults(scheduler="latency_hiding")
    assert LHS not in flags and flags == os.environ["XLA_FLAGS"]
    assert xla_flags.effective_scheduler() == "default"
    with pytest.raises(ValueError, match="is not one of"):
        xla_flags.apply_defaults(scheduler="fast")


def test_scheduler_not_in_effect_warns_once_on_gpu_only(_flags, caplog):
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        assert xla_flags.check_scheduler("latency_hiding", "cpu", flags="")  # no effect off GPU: quiet
        assert xla_flags.check_scheduler("latency_hiding", "gpu", flags=LHS)
        assert not xla_flags.check_scheduler("latency_hiding", "gpu", flags="")
        assert not xla_flags.check_scheduler("latency_hiding", "cuda", flags="")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "parallel.xla_scheduler=latency_hiding did not take effect" in warning and LHS in warning


# ----------------------------------------------------------------------------- the trace reader

_XSPACE = """
planes {{
  id: 1 name: "/device:GPU:0"
  lines {{ id: 1 name: "Stream #13(Compute)" timestamp_ns: 0 {compute} }}
  lines {{ id: 2 name: "Stream #14(Nccl)" timestamp_ns: 0 {nccl} }}
  lines {{ id: 3 name: "XLA Ops" timestamp_ns: 0 events {{ metadata_id: 4 offset_ps: 0 duration_ps: 99000000 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "xmoe_gmm" }} }}
  event_metadata {{ key: 3 value {{ id: 3 name: "loop_gelu_fusion" }} }}
  event_metadata {{ key: 4 value {{ id: 4 name: "all-to-all-start.1" }} }}
}}
planes {{ id: 2 name: "/host:CPU" }}
"""


def _event(meta: int, start_ms: float, dur_ms: float) -> str:
    return (
        f"events {{ metadata_id: {meta} offset_ps: {int(start_ms * 1e9)} duration_ps: {int(dur_ms * 1e9)} }}"
    )


def test_kernel_overlap_measures_nccl_time_under_gemms():
    from jax.profiler import ProfileData

    # NCCL 0-4 ms and 10-12 ms; GEMMs 2-6 ms and 3-5 ms (one union, 2-6); other compute 11-20 ms
    compute = " ".join([_event(2, 2, 4), _event(2, 3, 2), _event(3, 11, 9)])
    nccl = " ".join([_event(1, 0, 4), _event(1, 10, 2)])
    profile = ProfileData.from_text_proto(_XSPACE.format(compute=compute, nccl=nccl))
    (rep,) = kernel_overlap.report(kernel_overlap.device_kernels(profile)).values()
    assert rep["kernels"] == 5
    np.testing.assert_allclose(
        [
            rep["nccl_ms"],
            rep["gemm_ms"],
            rep["overlap_ms"],
            rep["overlap_compute_ms"],
            rep["nccl_under_gemm"],
        ],
        [6.0, 4.0, 2.0, 3.0, 2.0 / 6.0],
    )
    assert "CONCURRENT" in kernel_overlap.format_report({"/device:GPU:0": rep})
    serial = ProfileData.from_text_proto(_XSPACE.format(compute=_event(2, 5, 1), nccl=_event(1, 0, 4)))
    (rep,) = kernel_overlap.report(kernel_overlap.device_kernels(serial)).values()
    assert rep["overlap_ms"] == 0 and "serial" in kernel_overlap.format_report({"gpu": rep})
    assert [
        kernel_overlap.kernel_kind(n)
        for n in ("nvjet_hsh_128x256", "sm90_xmma_gemm_bf16", "fusion_3", "xmoe_push_mosaic_gpu_kernel")
    ] == ["gemm", "gemm", "compute", "nccl"]
    # our push kernel is the exchange; the GEMM with the push inside it stays a GEMM
    assert kernel_overlap.kernel_kind("xmoe_gmm_ws_push_mosaic_gpu_kernel") == "gemm"
