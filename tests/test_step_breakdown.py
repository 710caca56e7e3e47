"""scripts/step_breakdown.py on hand-built traces (the planes, lines, kernels and stats a GPU trace
holds) and on a real CPU trace: categories, unions, priority, exposed vs hidden exchange, idle,
and rows that sum to the step's window."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from xmoe_jax.perf import step_breakdown as sb
from xmoe_jax.perf import step_report, trace_kernels

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "step_breakdown.py"
# Two real traces of one H100 (jax 0.11.2), cut to the kernels' names, times and XLA's stats and
# the host's step events: 3 steps of a jitted step of 2 micro-batches x 4 remat'd layers (cuDNN
# attention, GEMMs under an `experts` scope) + optax.adamw; "graphs" as XLA runs it (CUDA graphs),
# "no_graphs" with XLA_FLAGS=--xla_gpu_enable_command_buffer=.
H100_TRACES = pathlib.Path(__file__).resolve().parent / "h100_step_traces.json.gz"

GRAD = "while/body/closed_call/jvp()/layer"
BWD = "while/body/closed_call/transpose(jvp())/checkpoint"


class Trace:
    """An XSpace text proto: one plane per GPU, a line per stream, a kernel per event (in ms)."""

    def __init__(self):
        self.names: dict[str, int] = {}
        self.planes: list[str] = []

    def _id(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names) + 1)

    def event(self, event_name: str, start: float, end: float, **stats) -> str:
        text = " ".join(
            f"stats {{ metadata_id: {self._id(k)} ref_value: {self._id(str(v))} }}" for k, v in stats.items()
        )
        ps = lambda ms: int(round(ms * 1e9))  # noqa: E731
        return f"events {{ metadata_id: {self._id(event_name)} offset_ps: {ps(start)} duration_ps: {ps(end - start)} {text} }}"

    def plane(self, name: str, lines: dict[str, list[str]]) -> None:
        body = " ".join(
            f'lines {{ id: {i} name: "{line}" timestamp_ns: 0 {" ".join(events)} }}'
            for i, (line, events) in enumerate(lines.items(), 1)
        )
        self.planes.append(f'planes {{ id: {len(self.planes) + 1} name: "{name}" {body} }}')

    def text(self) -> str:
        quote = lambda n: n.replace("\\", "\\\\").replace('"', '\\"')  # noqa: E731
        meta = " ".join(
            f'event_metadata {{ key: {i} value {{ id: {i} name: "{quote(n)}" }} }} '
            f'stat_metadata {{ key: {i} value {{ id: {i} name: "{quote(n)}" }} }}'
            for n, i in self.names.items()
        )  # every plane gets the same tables: ids are global here
        return "\n".join(p[:-1] + meta + " }" for p in self.planes)

    def write(self, folder: pathlib.Path) -> pathlib.Path:
        path = folder / "plugins" / "profile" / "2026_01_01" / "host.xplane.pb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(ProfileData.text_proto_to_serialized_xspace(self.text()))
        return folder


def k(
    trace: Trace,
    name: str,
    start: float,
    end: float,
    stack: str | None = None,
    op: str = "fusion.1",
    module: str = "jit_step",
):
    """A kernel as XLA annotates it: program prefix + relative name stack, HLO op, program."""
    stats = {"hlo_op": op, "hlo_module": module, "prefix": "jit(step)"}
    if stack:
        stats["name"] = stack
    return trace.event(name, start, end, **stats)


def _step_trace() -> Trace:
    """Two steps on one GPU, 11 ms: every category once, two streams, a busy NCCL stream."""
    t = Trace()
    compute = [
        k(t, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 0, 2, GRAD),  # attention 2
        k(t, "xmoe_gmm", 2, 4, GRAD + "/experts"),  # expert GEMMs: union 2-5 with the tgmm = 3
        k(t, "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT", 5, 6, GRAD),  # other GEMM 1
        k(t, "loop_add_fusion", 6, 7, "while/body/add"),  # micro-batch loop 1
        k(t, "loop_tanh_fusion", 7, 7.5, BWD + "/rematted_computation/tanh"),  # recompute
        k(t, "loop_multiply_fusion", 9.5, 10, None, op="fusion.7"),  # top level: optimizer 0.5
        k(t, "input_reduce_fusion", 10, 10.5, "metrics", module="jit_metrics"),  # other program 0.5
        k(t, "loop_fusion", 10.5, 11, BWD, op="fusion.3.remat"),  # XLA's remat: recompute
        k(t, "input_reduce_fusion", 12, 13, "metrics", module="jit_metrics"),  # outside the window
    ]
    second = [
        k(t, "xmoe_tgmm", 3, 5, BWD + "/experts"),
        k(t, "nvjet_tst_64x8", 7, 7.5, BWD),  # under the recompute kernel: recompute keeps it
    ]
    nccl = [
        k(t, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 4.5, 8, GRAD, op="all-to-all.2"),
        k(t, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8, 9, BWD, op="all-reduce.1"),
    ]
    t.plane(
        "/device:GPU:0",
        {"Stream #13(Kernel)": compute, "Stream #20(Kernel)": second, "Stream #14(Kernel)": nccl},
    )
    t.plane(
        "/host:CPU",
        {"python": [t.event("PjitFunction(step)", 0, 0.1), t.event("PjitFunction(step)", 5, 5.1)]},
    )
    return t


EXPECTED = {  # ms over the two steps
    "optimizer": 0.5,
    "recompute": 1.0,
    "attention": 2.0,
    "expert_gemm": 3.0,
    "other_gemm": 1.0,
    "loop": 1.0,
    "other_compute": 0.0,
    "other_programs": 0.5,
    "exchange_exposed": 1.5,
    "idle": 0.5,
}


def test_categories_union_priority_and_exchange_sum_to_the_window(tmp_path):
    rep = sb.breakdown(str(_step_trace().write(tmp_path)), steps=2)
    gpu = rep["gpus"]["GPU0"]
    assert rep["module"] == "jit_step" and gpu["steps_from"] == "--steps"
    assert gpu["ms"] == pytest.approx({c: v / 2 for c, v in EXPECTED.items()})
    assert sum(gpu["ms"].values()) == pytest.approx(gpu["step_ms"]) and gpu["step_ms"] == pytest.approx(5.5)
    # the SendRecv ran 4.5-8 ms: 3 ms under compute kernels, 0.5 ms alone; the all-reduce alone
    assert gpu["exchange_hidden_ms"] == pytest.approx(1.5) and gpu["exchange_total_ms"] == pytest.approx(2.25)
    kinds = {(c, f): v for c, fields in gpu["exchange_by_collective"].items() for f, v in fields.items()}
    assert kinds == pytest.approx(
        {
            ("all-to-all", "total_ms"): 1.75,
            ("all-to-all", "exposed_ms"): 0.25,
            ("all-reduce", "total_ms"): 0.5,
            ("all-reduce", "exposed_ms"): 0.5,
        }
    )
    assert rep["mean"]["ms"] == pytest.approx(gpu["ms"]) and rep["unidentified"] == []
    assert rep["top_kernels"]["expert_gemm"][0][0] in ("xmoe_gmm", "xmoe_tgmm")
    table = step_report.format_table(rep)
    assert (
        "| expert GEMMs | 1.50 | 1.50 | 27.3% |" in table
        and "| **step (sum)** | 5.50 | 5.50 | 100% |" in table
    )
    assert "optimizer & update > recompute > attention" in table


def test_the_step_hlo_names_the_kernels_the_trace_names_by_program_only(tmp_path, capsys):
    """A multi-output fusion carries only the program's name in the trace (`jit(step)`), so the top-level
    rule counts it as the optimizer (on one H200, XLA's gather of tgmm's rows). `--hlo` (the step's
    optimized HLO) gives it its instruction's op_name: here an experts' gather in the backward pass,
    other compute; kernels the trace names are left as they are."""
    from xmoe_jax.perf.hlo import op_names

    hlo = "\n".join(
        [
            "HloModule jit_step, entry_computation_layout={()->()}",
            "  %fusion.7 = (bf16[8,4]{1,0}, bf16[8,4]{1,0}) fusion(%p.1, %p.2), kind=kLoop, calls=%fused_select, "
            'metadata={op_name="jit(step)/transpose(jvp())/eval_jaxpr/experts/jit(_take)/select_n"}',
            '  ROOT %fusion.1 = f32[8]{0} fusion(%p.3), kind=kLoop, calls=%c, metadata={op_name="jit(step)/optimizer/add"}',
        ]
    )
    names = op_names(hlo)
    assert (
        names["fusion.7"].endswith("experts/jit(_take)/select_n")
        and names["fusion.1"] == "jit(step)/optimizer/add"
    )
    folder = str(_step_trace().write(tmp_path / "profile"))
    gpu = sb.breakdown(folder, steps=2, hlo_names=names)["gpus"]["GPU0"]
    moved = {**EXPECTED, "optimizer": 0.0, "other_compute": 0.5}
    assert gpu["ms"] == pytest.approx({c: v / 2 for c, v in moved.items()})
    (tmp_path / "step.txt").write_text(hlo)
    assert _run_script([folder, "--steps", "2", "--hlo", str(tmp_path / "step.txt")]) == 0
    assert "| optimizer & update | 0.00 |" in capsys.readouterr().out
    assert _run_script([folder, "--steps", "2", "--hlo", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_step_count_from_the_host_dispatches_and_the_mean_over_gpus(tmp_path):
    t = _step_trace()
    # a second GPU: GEMMs for 10 of the same 11 ms
    gemms = [k(t, "nvjet_hsh_128x256", 0, 9, GRAD), k(t, "nvjet_hsh_128x256", 10, 11, GRAD)]
    t.plane("/device:GPU:1", {"Stream #13(Kernel)": gemms})
    rep = sb.breakdown(str(t.write(tmp_path)))
    assert [g["steps"] for g in rep["gpus"].values()] == [2, 2] and list(rep["gpus"]) == ["GPU0", "GPU1"]
    assert rep["gpus"]["GPU1"]["steps_from"] == "host events PjitFunction(step)"
    assert rep["gpus"]["GPU1"]["ms"]["other_gemm"] == pytest.approx(5.0)
    assert rep["mean"]["ms"]["other_gemm"] == pytest.approx((0.5 + 5.0) / 2)
    assert rep["mean"]["ms"]["idle"] == pytest.approx((0.25 + 0.5) / 2)
    assert sum(rep["mean"]["ms"].values()) == pytest.approx(rep["mean"]["step_ms"]) == 5.5


def test_the_tail_of_an_earlier_step_stays_out_of_the_window(tmp_path):
    """Kernels before the first traced dispatch belong to the step before the trace."""
    t = Trace()
    kernels = [k(t, "nvjet_hsh", a, b, GRAD) for a, b in ((0, 1), (3, 5), (6, 8))]
    t.plane("/device:GPU:0", {"Stream #7(Kernel)": kernels})
    execute = "CommonPjRtLoadedExecutable::Execute (jit_step)"
    runs = [t.event(execute, 2, 5.5), t.event(execute, 5.5, 9)]
    t.plane("/host:CPU", {"python3": runs, "worker": runs})  # a step per thread still counts once
    gpu = sb.breakdown(str(t.write(tmp_path)))["gpus"]["GPU0"]
    assert (gpu["steps"], gpu["steps_from"]) == (2, "host events Execute (jit_step)")
    assert gpu["step_ms"] == pytest.approx(2.5) and gpu["ms"]["other_gemm"] == pytest.approx(2.0)


def test_without_name_stacks_the_stack_categories_are_reported_unidentified(tmp_path):
    t = Trace()
    kernels = [
        t.event("nvjet_hsh_128x256", 0, 2),
        t.event("loop_fusion", 3, 4),
        t.event("ncclDevKernel_SendRecv", 3.5, 5),
    ]
    t.plane("/device:GPU:0", {"Stream #7(Kernel)": kernels})
    rep = sb.breakdown(str(t.write(tmp_path)), steps=1)
    gpu = rep["gpus"]["GPU0"]
    assert rep["unidentified"] == ["optimizer", "recompute", "loop"] and rep["module"] is None
    assert gpu["ms"]["other_gemm"] == 2 and gpu["ms"]["other_compute"] == 1 and gpu["ms"]["idle"] == 1
    assert gpu["ms"]["exchange_exposed"] == pytest.approx(1) and gpu["exchange_hidden_ms"] == pytest.approx(
        0.5
    )
    assert sum(gpu["ms"].values()) == pytest.approx(5)
    assert "| recompute | n/a | n/a | n/a |" in step_report.format_table(rep)
    assert any("could not be identified" in n for n in rep["notes"])


def test_xprof_lines_give_the_steps_and_the_name_stacks(tmp_path):
    """A trace that went through xprof: `XLA Modules` events are the steps, `XLA Ops` events carry
    the op's name stack (`tf_op`) for the kernels under them."""
    t = Trace()
    kernels, ops, modules = [], [], []
    for s in range(3):
        base = 10 * s
        kernels += [t.event("nvjet_hsh", base, base + 2), t.event("loop_fusion", base + 2, base + 3)]
        ops += [
            t.event("fusion.1", base, base + 2, tf_op="jit(step)/jvp()/dot_general"),
            t.event("fusion.2", base + 2, base + 3, tf_op="jit(step)/sqrt"),
        ]
        modules.append(t.event("jit_step(8)", base, base + 3))
    t.plane("/device:GPU:0", {"XLA Modules": modules, "XLA Ops": ops, "Stream #7(Kernel)": kernels})
    rep = sb.breakdown(str(t.write(tmp_path)))
    gpu = rep["gpus"]["GPU0"]
    assert (gpu["steps"], gpu["steps_from"], rep["module"]) == (3, "XLA Modules line", "jit_step")
    assert gpu["ms"]["other_gemm"] == pytest.approx(2) and gpu["ms"]["optimizer"] == pytest.approx(1)
    assert gpu["step_ms"] == pytest.approx(23 / 3) and gpu["ms"]["idle"] == pytest.approx(14 / 3)


def test_name_stack_and_region_rules():
    assert (
        trace_kernels.name_stack({"prefix": "jit(step)", "name": "jvp()/dot_general"})
        == "jit(step)/jvp()/dot_general"
    )
    assert (
        trace_kernels.name_stack({"prefix": "jit(step)", "hlo_op": "fusion.2"}) == "jit(step)"
    )  # an op named the prefix
    assert trace_kernels.name_stack({"prefix": "jit(step)", "hlo_op": "copy.4"}) is None  # XLA's own copy
    assert trace_kernels.name_stack({"tf_op": "XlaModule:"}) is None
    assert (
        trace_kernels.name_stack({"long_name": '%f = f32[] fusion(), metadata={op_name="jit(f)/mul"}'})
        == "jit(f)/mul"
    )
    assert [
        sb.region(s) for s in ("jit(step)/jvp(attn)/tanh", "jit(step)/while/body/add", "jit(step)/sqrt")
    ] == [
        "grad",
        "loop",
        "top",
    ]


def test_kernel_rules_for_our_kernels_and_scopes_under_transforms():
    grad = "jit(step)/transpose(jvp(experts))/dot_general"

    def cat(name, stack=grad, op="fusion.1"):
        return sb._category(sb.Kernel(0, 1, name, op, "jit_step", stack), "jit_step")

    assert cat("sm90_xmma_gemm_bf16bf16_bf16f32") == "expert_gemm"  # a GEMM under the experts scope
    assert cat("sm90_xmma_gemm_bf16", "jit(step)/jvp(shared_experts)/dot_general") == "other_gemm"
    assert cat("xmoe_gather_dot", grad) == "other_compute"  # our permutation kernel: no GEMM
    assert (
        cat("ragged_dot", None) == "expert_gemm" and cat("gemm_fusion", None, "ragged-dot.2") == "expert_gemm"
    )
    assert cat("loop_fusion", None, "all-reduce-start.1") == "exchange"  # a collective by its op
    # our push kernel (kernels/push) is the exchange, of its own kind; the GEMM with the push inside is a GEMM
    push = sb.Kernel(0, 1, "xmoe_push_mosaic_gpu_kernel", "custom-call.3", "jit_step", grad)
    assert sb._category(push, "jit_step") == "exchange" and sb.collective_kind(push) == "push"
    assert cat("xmoe_gmm_ws_push_mosaic_gpu_kernel") == "expert_gemm"
    assert cat("mha_forward", None) == "attention" and cat("fmha_v2_flash", None) == "attention"
    assert cat("nvjet_hsh", "jit(step)/jvp()/rematted_computation/dot_general") == "recompute"
    assert cat("loop_fusion", "jit(step)/optax/adam/mul") == "optimizer"
    assert sb.in_scope("a/jvp(experts)/b", "experts") and not sb.in_scope("a/shared_experts/b", "experts")


def _h100(which: str, folder: pathlib.Path) -> pathlib.Path:
    t = Trace()
    for plane, lines in json.loads(gzip.decompress(H100_TRACES.read_bytes()))[which].items():
        events = {
            line: [t.event(n, a / 1e6, b / 1e6, **stats) for n, a, b, stats in evs]
            for line, evs in lines.items()
        }
        t.plane(plane, events)
    return t.write(folder)


def test_real_h100_traces(tmp_path):
    """What jax 0.11.2 writes: per-op name stacks without CUDA graphs, the graph's shared one with."""
    rep = sb.breakdown(str(_h100("no_graphs", tmp_path / "a")))
    gpu = rep["gpus"]["GPU0"]
    assert (gpu["steps"], gpu["steps_from"], rep["module"]) == (
        3,
        "host events Execute (jit_step)",
        "jit_step",
    )
    ms = gpu["ms"]
    assert sum(ms.values()) == pytest.approx(gpu["step_ms"]) and gpu["name_stack_coverage"] > 0.95
    assert {c: round(ms[c], 2) for c in ("optimizer", "recompute", "attention", "expert_gemm", "loop")} == {
        "optimizer": 0.05,
        "recompute": 0.21,
        "attention": 0.38,
        "expert_gemm": 0.25,
        "loop": 0.10,
    }
    assert ms["exchange_exposed"] == 0 and not any("CUDA graphs" in n for n in rep["notes"])
    # device copies by source: the layer scan's parameter slices (dynamic_index_in_dim) lead
    top_copy = rep["copies"][0][0]
    assert top_copy.startswith("MemcpyD2D: loop_dynamic_slice_fusion @ ") and "while/body" in top_copy
    assert "Device copies by source" in step_report.format_table(rep)
    # other compute by source (issue 35: every kernel named by where it comes from), summing to its row
    other = rep["other_compute"]
    assert other and all(" @ " in src and not src.startswith("Memcpy") for src, _, _ in other)
    assert sum(m for _, m, _ in other) <= rep["mean"]["ms"]["other_compute"] + 1e-6
    assert "Other compute by source" in step_report.format_table(rep)
    rep = sb.breakdown(str(_h100("graphs", tmp_path / "b")))
    assert rep["gpus"]["GPU0"]["steps"] == 3 and rep["mean"]["cuda_graph_share"] > 0.9
    assert rep["mean"]["ms"]["attention"] > 0.2 and rep["mean"]["ms"]["optimizer"] > 0
    assert any("--xla_gpu_enable_command_buffer=" in n for n in rep["notes"])


def _run_script(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("step_breakdown_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_cli_writes_json_and_a_plot(tmp_path, capsys):
    folder = _step_trace().write(tmp_path / "profile")
    out, png = tmp_path / "report.json", tmp_path / "breakdown.png"
    assert _run_script([str(folder), "--steps", "2", "--out", str(out), "--plot", str(png)]) == 0
    assert "| attention | 1.00 | 1.00 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["gpus"]["GPU0"]["steps"] == 2
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_on_a_real_cpu_trace_says_so_in_one_line(tmp_path, capsys):
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((16, 16))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "profile")):
        f(x).block_until_ready()
    assert _run_script([str(tmp_path / "profile"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no GPU plane (/device:GPU:<i>)")
    assert _run_script([str(tmp_path / "nothing")]) == 2
    assert "no *.xplane.pb under" in capsys.readouterr().err
