"""The memory planner (xmoe_jax/plan.py, xmoe-plan): exact state sizes from shardings, compiled
temporaries, and advice when a plan does not fit."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from xmoe_jax import count_params
from xmoe_jax.config import load_config
from xmoe_jax.plan import GiB, plan

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def replicated():
    return load_config(TINY, ["mesh.data=8", "parallel.dispatch=pft"])


def test_state_sizes_are_exact(replicated):
    p = plan(replicated, device_memory=64 * GiB)
    total = count_params(replicated.model).total
    assert p.params == 4 * total  # float32 masters, replicated over data
    assert p.optimizer >= 2 * p.params  # AdamW's two moments (plus counters)
    assert p.gradients == 4 * total  # float32, one per parameter, replicated (counted from the model)
    assert p.bytes_per_param == pytest.approx(
        {"params": 4, "moments": 8, "gradients": 4, "accumulators": 0}, rel=1e-3
    )
    assert p.temporaries > 0 and p.peak >= p.arguments
    assert p.fits and p.advice == []
    assert "fits" in p.table()


@pytest.mark.slow  # ~17 s
def test_expert_parallel_and_fsdp_divide_the_state(replicated):
    ep = plan(load_config(TINY, ["mesh.expert=8", "parallel.dispatch=pft"]))
    fsdp = plan(load_config(TINY, ["mesh.data=8", "mesh.fsdp=true", "parallel.dispatch=pft"]))
    base = plan(replicated)
    assert ep.params < base.params and fsdp.params < base.params


@pytest.mark.slow  # ~23 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_advice_names_settings_when_it_does_not_fit(replicated):
    p = plan(replicated, device_memory=2**20)
    assert p.fits is False
    text = " ".join(p.advice)
    assert "model.remat" in text and "recv_buffer_factor" in text and "GiB over" not in text
    assert "device memory" in p.table() and "does NOT fit, " in p.table() and "GiB over" in p.table()
    assert "try: (" not in p.table()  # the overage is a statement, not a suggestion


@pytest.mark.slow  # ~29 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_cli_plans_for_fake_devices(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "xmoe_jax.cli_plan", "--config", str(TINY), "--devices", "4",
           "--device-memory", "1GiB", "--set", "mesh.expert=4", "--set", "parallel.dispatch=pft", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 devices (fake CPU devices" in done.stdout and "fits" in done.stdout
    # progress on stderr while it works (issue 31: silent for up to 141 s), the table alone on stdout
    assert "xmoe-plan: compiling the train step for 4 devices" in done.stderr and "compiled in" in done.stderr
    assert "xmoe-plan:" not in done.stdout
    data = json.loads(out.read_text())
    assert data["devices"] == 4 and data["mesh"]["expert_per_node"] == 4


@pytest.mark.parametrize("where", ["file_as_folder", "missing_folder", "folder"])
def test_cli_refuses_an_out_path_it_cannot_write_before_compiling(tmp_path, capsys, where):
    """Issue 31: `--out` under a file or a missing folder gave a traceback after the whole compile."""
    from xmoe_jax.cli import plan_main

    (tmp_path / "a_file").write_text("x")
    out = {"file_as_folder": tmp_path / "a_file" / "plan.json", "missing_folder": tmp_path / "no" / "plan.json",
           "folder": tmp_path}[where]  # fmt: skip
    assert plan_main(["--config", str(TINY), "--devices", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "\n" not in err and str(out) in err, err


@pytest.mark.slow  # ~64 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_plan_compiles_the_step_the_trainer_runs_first():
    """Dropless pft with adaptive buffers: planned at the ladder's first rung (1.2x) with the
    transport a GPU resolves `auto` to (bucketed), each said in a note; fixed buffers plan as set."""
    base = ["mesh.expert=8", "parallel.dispatch=pft", "model.moe.capacity_factor=null"]
    adaptive = plan(load_config(TINY, base))
    assert any("1.2x the average load" in n for n in adaptive.notes)
    assert any("bucketed" in n for n in adaptive.notes) and "note: " in adaptive.table()
    worst = plan(load_config(TINY, [*base, "parallel.adaptive_buffers=false", "parallel.transport=emulated"]))
    assert worst.notes == [] and worst.temporaries > adaptive.temporaries


@pytest.mark.parametrize(
    "overrides, want",
    [
        ([], {"params": 4, "moments": 8, "gradients": 4, "accumulators": 0}),
        (["optimizer.state_dtype=bfloat16"], {"params": 4, "moments": 4, "gradients": 4, "accumulators": 0}),
        (
            ["optimizer.state_dtype=bfloat16", "model.param_dtype=bfloat16", "train.micro_batch_size=4"],
            {"params": 2, "moments": 4, "gradients": 2, "accumulators": 4},
        ),
        (["train.micro_batch_size=4", "train.grad_accum_dtype=bfloat16"],
         {"params": 4, "moments": 8, "gradients": 4, "accumulators": 2}),
        (["mesh.data=8", "mesh.fsdp=true"], {"params": 4, "moments": 8, "gradients": 4, "accumulators": 0}),
    ],
)  # fmt: skip
def test_state_bytes_per_param(overrides, want):
    """The state's breakdown from shardings alone (no compile): float32 or bfloat16 moments."""
    import jax

    from xmoe_jax.plan import state_bytes_per_param
    from xmoe_jax.sharding import make_mesh
    from xmoe_jax.train import state as tstate

    cfg = load_config(TINY, overrides)
    state = tstate.build(cfg, make_mesh(cfg.mesh)).abstract()
    got = state_bytes_per_param(cfg, state)
    assert got == pytest.approx(want, rel=1e-3)  # moments include AdamW's step counters
    moments = jax.tree.leaves((state.opt[1][0].mu, state.opt[1][0].nu))
    assert {str(m.dtype) for m in moments} == {cfg.optimizer.state_dtype}
    if cfg.mesh.fsdp:  # the moments follow their params' sharding (FSDP over every data rank)
        assert all(
            m.sharding == p.sharding
            for m, p in zip(moments[: len(moments) // 2], jax.tree.leaves(state.params), strict=True)
        )


def test_breakdown_names_what_each_policy_keeps():
    """`xmoe-plan --breakdown`: the traced program's residuals by category, per token per layer. Full
    recomputation keeps the block inputs only; none keeps the expert hidden; on one device neither
    keeps the [K*T, D] permuted rows nor the experts' outputs (moe/experts.py's custom VJPs)."""
    from xmoe_jax.perf.breakdown import activation_breakdown

    over = [
        "parallel.dispatch=pft",
        "model.moe.capacity_factor=null",
        "model.dtype=bfloat16",
        "model.num_dense_layers=0",
        "model.moe.num_shared_experts=0",
    ]
    none = activation_breakdown(load_config(TINY, over))
    full = activation_breakdown(load_config(TINY, [*over, "model.remat=full"]))
    cfg = load_config(TINY, over).model
    d, f, k = cfg.hidden, cfg.moe.expert_hidden, cfg.moe.top_k
    n = 2 if cfg.moe.activation == "swiglu" else 1
    assert none.per_token_per_layer("expert hidden") == pytest.approx(2 * n * k * f, rel=0.01)
    assert none.per_token_per_layer("permuted rows / exchange") < 2 * k * d / 4
    assert none.per_token_per_layer("combine") < 2 * k * d / 4
    kept_full = sum(full.per_category.get(c, 0) for c in ("attention", "expert hidden", "combine"))
    assert kept_full == 0 and full.per_token_per_layer("norms / residual stream") == pytest.approx(
        2 * d, rel=0.05
    )
    assert "kept for the backward pass" in "\n".join(none.table())
