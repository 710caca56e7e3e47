"""Switches that cannot apply are refused when the config is built (config/applies.py, issue 31
item 4): each message names the field and the fix. Config-only: no JAX step is compiled here."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from xmoe_jax.config import Config, ConfigError, load_config, loading, override_dict, yaml_io
from xmoe_jax.config.applies import REFUSALS, Refusal, check_switches, table
from xmoe_jax.config.choices import EXCHANGE_DISPATCH
from xmoe_jax.moe.dispatchers import DISPATCHERS, exchanges_tokens

TINY = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"  # pft on 1 expert device
EXCHANGE = ["parallel.dispatch=pft", "mesh.expert=4"]
ORACLE = "parallel.dispatch=dense"
DENSE_MODEL = ["model.moe=null", "model.num_dense_layers=3"]  # no routed experts


@pytest.mark.parametrize(
    "overrides, field, fix",
    [
        # the case: experts-only / dispatch-only FP8 under dense dispatch ran nothing in FP8
        ([ORACLE, "model.fp8={projections: false}"], "model.fp8.experts=true", "parallel.dispatch=pft"),
        ([ORACLE, "model.fp8={recipe: rowwise}"], "model.fp8.experts=true", "model.fp8.experts=false"),
        (["model.fp8={projections: false, experts: false, dispatch: true}"], "model.fp8.dispatch=true",
         "model.fp8.dispatch=false"),
        (["parallel.dispatch=pft", "model.fp8={experts: false, dispatch: true}"], "model.fp8.dispatch=true",
         "mesh.expert > 1"),  # one expert device: nothing crosses the wire
        (["parallel.dispatch=rbd", "mesh.expert=2", "mesh.expert_nodes=2", "model.fp8={dispatch: true}"],
         "model.fp8.dispatch=true", "model.fp8.dispatch=false"),  # rbd: one device per node
        (["model.moe=null", "model.num_dense_layers=3", "model.fp8={experts: true}"], "model.fp8.experts=true",
         "model.fp8.experts=false"),
        (["parallel.transport=ragged"], "parallel.transport='ragged'", "parallel.transport=auto"),
        (["parallel.dispatch=pft", "parallel.transport=bucketed"], "parallel.transport='bucketed'", "mesh.expert > 1"),
        (["parallel.recv_buffer_factor=1.5"], "parallel.recv_buffer_factor=1.5", "recv_buffer_factor=null"),
        (["parallel.adaptive_buffers=false"], "parallel.adaptive_buffers=false", "remove it"),
        ([*EXCHANGE, "model.moe.capacity_factor=1.25", "parallel.adaptive_buffers=false"],
         "parallel.adaptive_buffers=false", "capacity_factor"),
        (["parallel.buffer_shrink_after=50"], "parallel.buffer_shrink_after=50", "remove it"),
        ([ORACLE, "parallel.overlap_chunks=2"], "parallel.overlap_chunks=2", "parallel.overlap_chunks=1"),
        (["parallel.dispatch=pft", "parallel.auto_shard=true", "parallel.overlap_chunks=2"],
         "parallel.overlap_chunks=2", "auto_shard=false"),
        (["parallel.ssmb=true"], "parallel.ssmb=true", "mesh.tensor > 1"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true", "parallel.sequence_parallel=false"),
        (["parallel.expert_tensor_parallel=true"], "parallel.expert_tensor_parallel=true", "mesh.tensor > 1"),
        ([*EXCHANGE, "model.moe.score_func=sigmoid", "model.moe.num_groups=1", "parallel.route_groups_by_node=true"],
         "parallel.route_groups_by_node=true", "parallel.dispatch=rbd"),
        (["model.moe.num_shared_experts=0", "model.moe.shared_expert_gate=true"],
         "model.moe.shared_expert_gate=true", "model.moe.num_shared_experts >= 1"),
        (["model.moe.num_shared_experts=0", "model.moe.shared_expert_hidden=32"],
         "model.moe.shared_expert_hidden=32", "shared_expert_hidden=null"),
        (["model.moe.bias_update_rate=0.01"], "model.moe.bias_update_rate=0.01", "score_func=sigmoid"),
        (["model.unroll_layers=true", "model.scan_unroll=2"], "model.scan_unroll=2", "model.scan_unroll=1"),
        (["train.steps=5", "train.profile_steps=[6, 8]"], "train.profile_steps=[6, 8]", "train.profile_steps=[1, 3]"),
        (["train.grad_accum_dtype=bfloat16"], "train.grad_accum_dtype=bfloat16", "train.micro_batch_size"),
        (["train.batch_size=8", "train.micro_batch_size=8", "train.grad_accum_dtype=bfloat16"],
         "train.grad_accum_dtype=bfloat16", "grad_accum_dtype=float32"),
    ],
)  # fmt: skip
def test_a_switch_that_cannot_apply_is_refused_with_its_fix(overrides, field, fix):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    msg = str(e.value)
    assert field in msg and fix in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.fp8={projections: true, experts: false}"],  # dense MLPs and attention in FP8
        ["parallel.dispatch=pft", "model.fp8={recipe: rowwise}"],  # grouped GEMMs on one device too
        [*EXCHANGE, "model.fp8={dispatch: true}", "parallel.transport=ragged", "parallel.recv_buffer_factor=1.5"],
        [*EXCHANGE, "parallel.adaptive_buffers=false", "parallel.buffer_shrink_after=10", "parallel.overlap_chunks=2"],
        ["parallel.dispatch=rbd", "mesh.expert=4", "mesh.expert_nodes=2", "model.fp8={dispatch: true}"],
        ["mesh.tensor=2", "parallel.ssmb=true", "parallel.sequence_parallel=true"],
        ["model.moe.score_func=sigmoid", "model.moe.bias_update_rate=0.01"],
        ["train.steps=5", "train.profile_steps=[5, 9]"],
        ["train.batch_size=8", "train.micro_batch_size=2", "train.grad_accum_dtype=bfloat16"],
    ],
)  # fmt: skip
def test_switches_that_apply_are_accepted(overrides):
    load_config(TINY, overrides)


def test_fsdp_over_one_data_device_is_refused_with_the_device_count():
    cfg = load_config(TINY, ["mesh.fsdp=true"])
    assert cfg.validate_for_devices(8).data == 8
    with pytest.raises(ConfigError, match=r"mesh\.fsdp=true .* resolves to 1 device.*mesh\.fsdp=false"):
        cfg.validate_for_devices(1)


def test_the_exchange_modes_are_the_dispatcher_tables():
    assert set(EXCHANGE_DISPATCH) == {d for d in DISPATCHERS if exchanges_tokens(d)}


def test_every_shipped_config_passes():
    for path in sorted(TINY.parent.glob("*.yaml")):
        load_config(path)


def _unchecked(overrides) -> Config:
    """configs/tiny.yaml with `overrides`, built without the load-time refusals."""
    return loading._build(Config, override_dict(yaml_io.load_file(TINY), list(overrides)))


@pytest.mark.parametrize("row", REFUSALS, ids=lambda row: row.switches[0])
def test_every_row_of_the_table_is_refused_by_its_own_check_where_it_runs(row: Refusal, tmp_path):
    """applies.py's table is data: each row's check refuses the row's example, naming one of its
    switches, and runs where the row says (issue 37 section 4: a row without a check fails here)."""
    unchecked = _unchecked(row.example)
    with pytest.raises(ConfigError) as own:
        row.check(unchecked, 1) if row.when == "devices" else row.check(unchecked)
    assert any(f"{key}=" in str(own.value) for key in row.switches), own.value
    with pytest.raises(ConfigError) as where:
        if row.when == "load":
            load_config(TINY, list(row.example))
        cfg = load_config(TINY, [*row.example, f"train.run_dir={tmp_path / 'run'}"])
        if row.when == "devices":
            cfg.validate_for_devices(1)
        from xmoe_jax.train.loop import train  # the trainer refuses before it opens data or compiles

        train(cfg)
    assert str(where.value) == str(own.value)
    assert not (tmp_path / "run").exists()


def test_the_table_renders_every_row_and_load_runs_every_load_check(monkeypatch):
    assert all(", ".join(row.switches) in table() for row in REFUSALS)
    ran = []
    rows = tuple(dataclasses.replace(row, check=lambda cfg, r=row: ran.append(r)) for row in REFUSALS)
    monkeypatch.setattr("xmoe_jax.config.applies.REFUSALS", rows)
    check_switches(_unchecked(()))
    assert ran == [row for row in REFUSALS if row.when == "load"]


@pytest.mark.parametrize(
    "overrides, field, fix",
    [
        (["parallel.dispatch=pft"], "parallel.dispatch='pft'", "remove it"),
        (["parallel.dispatch=rbd"], "parallel.dispatch='rbd'", "remove it"),
        (["parallel.overlap_chunks=2"], "parallel.overlap_chunks=2", "parallel.overlap_chunks=1"),
        (["parallel.overlap=chunks", "parallel.overlap_chunks=2"], "parallel.overlap='chunks'", "parallel.overlap=none"),
    ],
)  # fmt: skip
def test_a_model_without_routed_experts_refuses_moe_placement(overrides, field, fix):
    """Issue 37 section 3.7: these switches place an MoE block a dense model does not have."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [*DENSE_MODEL, *overrides])
    msg = str(e.value)
    assert field in msg and "model.moe is null" in msg and fix in msg and "\n" not in msg, msg


def test_a_model_without_routed_experts_keeps_the_default_dispatch():
    """`auto` (the default) and `dense` (what runs before `auto` wrote) load for a dense model."""
    assert load_config(TINY, DENSE_MODEL).parallel.dispatch == "auto"
    assert load_config(TINY, [*DENSE_MODEL, ORACLE]).parallel.dispatch == "dense"
    assert Config(model=load_config(TINY, DENSE_MODEL).model).parallel.dispatch == "auto"


def test_a_tokenizer_with_synthetic_data_is_refused_by_the_trainer_only(tmp_path):
    """Issue 37 section 3.7: `data.tokenizer` with synthetic data tokenizes nothing. A run's
    config.yaml may hold one for the tools (an imported model's), so loading it stays accepted; the
    trainer refuses it before it opens its data."""
    from xmoe_jax.train.loop import train

    run = f"train.run_dir={tmp_path / 'run'}"
    cfg = load_config(TINY, ["data.tokenizer=tokenizer.json", run])  # generate/eval load it
    with pytest.raises(ConfigError) as e:
        train(cfg)
    msg = str(e.value)
    assert "data.tokenizer='tokenizer.json'" in msg and "data.path" in msg and "data.tokenizer=auto" in msg, (
        msg
    )
    for fine in (["data.tokenizer=bytes"], ["data.source=text", "data.path=x.txt", "data.tokenizer=t.json"]):
        applies_check = REFUSALS[-1].check
        applies_check(load_config(TINY, fine))  # bytes is what a synthetic run records; text is tokenized
