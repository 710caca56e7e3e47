"""Shipped configs parse and document themselves; overrides work; bad input names its field."""

from __future__ import annotations

import pathlib
import re

import pytest

from xmoe_jax.config import ConfigError, MeshShape, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").glob("*.yaml"))
TEXT_CONFIGS = [p for p in CONFIG_FILES if load_config(p).data.source == "text"]
TINY = ROOT / "configs" / "tiny.yaml"


def _header(path: pathlib.Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_configs_are_shipped() -> None:
    names = {p.stem for p in CONFIG_FILES}
    expected = {
        "tiny",
        "tiny_text",
        "tiny_hf",
        "small",
        "medium",
        "large",
        "super",
        "deepseek_moe_16b",
        "tiny_small_shape",
        "deepseek_v2_lite",
        "deepseek_v3",
        "tiny_deepseek",
    }
    assert expected <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_config_parses(path: pathlib.Path) -> None:
    cfg = load_config(path)
    assert cfg.model.num_layers >= 1
    assert cfg.train.seq_len <= cfg.model.max_seq_len


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_config_header_names_its_command(path: pathlib.Path) -> None:
    header = _header(path)
    assert header, f"{path.name} has no leading comment header"
    assert f"xmoe-train --config configs/{path.name}" in header
    assert "Expect" in header


@pytest.mark.parametrize("path", TEXT_CONFIGS, ids=lambda p: p.name)
def test_text_data_path_resolves_from_repo_root(path: pathlib.Path) -> None:
    data = ROOT / load_config(path).data.path
    if not data.parent.is_dir():
        pytest.skip(f"shared data directory {data.parent} is not present in this checkout")
    assert data.is_file()


def test_dotted_overrides_change_values() -> None:
    base = load_config(TINY)
    cfg = load_config(TINY, ["model.moe.top_k=4", "optimizer.lr=1e-3", "train.steps=7", "mesh.expert=2"])
    assert base.model.moe.top_k == 2
    assert cfg.model.moe.top_k == 4
    assert cfg.optimizer.lr == 1e-3
    assert cfg.train.steps == 7
    assert cfg.mesh.expert == 2
    assert cfg.model.hidden == base.model.hidden


def test_override_null_means_none() -> None:
    cfg = load_config(TINY, ["model.moe.capacity_factor=1.5"])
    assert cfg.model.moe.capacity_factor == 1.5
    assert load_config(TINY, ["model.moe.capacity_factor=null"]).model.moe.capacity_factor is None


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"model\.hiden"):
        load_config(TINY, ["model.hiden=32"])


def test_unknown_key_in_file_is_named(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  moe:\n    num_expert: 8\n")
    with pytest.raises(ConfigError, match=r"model\.moe\.num_expert"):
        load_config(bad)


def test_wrong_type_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.hidden must be int"):
        load_config(TINY, ["model.hidden=sixty-four"])
    bad = tmp_path / "bad.yaml"
    bad.write_text('train:\n  steps: "100"\n')
    with pytest.raises(ConfigError, match=r"train\.steps must be int"):
        load_config(bad)


def test_top_k_above_num_experts() -> None:
    with pytest.raises(ConfigError, match=r"top_k=9 must be in \[1, num_experts=8\]"):
        load_config(TINY, ["model.moe.top_k=9"])


def test_num_experts_not_divisible_by_expert_axis() -> None:
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by mesh\.expert=3"):
        load_config(TINY, ["mesh.expert=3"])


def test_missing_config_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config(missing)


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match=r"'model\.hidden' must look like section\.key=value"):
        load_config(TINY, ["model.hidden"])


def test_mesh_size_must_match_device_count() -> None:
    cfg = load_config(TINY, ["mesh.data=2", "mesh.expert=2"])
    assert cfg.validate_for_devices(4) == MeshShape(data=2, expert_nodes=1, expert_per_node=2, tensor=1)
    with pytest.raises(ConfigError, match=r"mesh size data\*expert\*tensor = 2\*2\*1 = 4 != 8 devices"):
        cfg.validate_for_devices(8)


def test_mesh_fill_resolves_data_axis() -> None:
    cfg = load_config(TINY, ["mesh.expert=2"])
    assert cfg.validate_for_devices(8) == MeshShape(data=4, expert_nodes=1, expert_per_node=2, tensor=1)
    with pytest.raises(ConfigError, match=r"mesh\.expert \* mesh\.tensor = 2 does not divide the 3 devices"):
        cfg.validate_for_devices(3)


def test_mesh_too_big_for_the_devices_names_sizes_that_fit() -> None:
    """Issue 31: `--set mesh.expert=8` on one CPU device said what was wrong, not what to set."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["mesh.expert=8"]).validate_for_devices(1)
    assert "set mesh.expert=1" in str(e.value) and "device_count=8" in str(e.value)
    with pytest.raises(ConfigError, match=r"set mesh\.expert=2 mesh\.tensor=1,"):
        load_config(TINY, ["mesh.expert=4", "mesh.tensor=2"]).validate_for_devices(2)


@pytest.mark.parametrize(
    "old, new",
    [
        ("model.moe.dispatch=pft", "parallel.dispatch"),
        ("model.moe.recv_buffer_factor=1.25", "parallel.recv_buffer_factor"),
        ("model.moe.ssmb=true", "parallel.ssmb"),
        ("model.sequence_parallel=true", "parallel.sequence_parallel"),
    ],
)
def test_placement_keys_moved_to_parallel_name_the_new_key(old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=rf"{old.split('=')[0]} moved to {new}"):
        load_config(TINY, [old])
    key, value = old.split("=")
    applies = ["parallel.dispatch=pft", "mesh.expert=2", "mesh.tensor=2"]  # where each switch applies
    cfg = load_config(TINY, [*applies, f"{new}={value}"])
    assert str(getattr(cfg.parallel, new.split(".")[1])).lower() == value


def test_choice_fields_are_checked_by_their_literal_type(tmp_path: pathlib.Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"parallel\.dispatch='nope' is not one of \['auto', 'dense', 'padded', 'pft', 'rbd'\]",
    ):
        load_config(TINY, ["parallel.dispatch=nope"])
    with pytest.raises(ConfigError, match=r"moe\.activation='relu' is not one of"):
        load_config(TINY, ["model.moe.activation=relu"])
    from xmoe_jax.config import MoEConfig

    with pytest.raises(ConfigError, match=r"moe\.score_func='x' is not one of"):
        MoEConfig(score_func="x")


def test_old_checkpoint_config_dicts_migrate() -> None:
    from xmoe_jax.config import Config, from_dict, migrate_dict, to_dict

    old = to_dict(Config())
    old["model"]["moe"]["dispatch"] = "rbd"
    old["model"]["moe"]["recv_buffer_factor"] = 1.5
    old["model"]["sequence_parallel"] = True
    old["mesh"].update(expert=2, tensor=2)  # where those switches apply (config/applies.py)
    del old["parallel"]
    cfg = from_dict(migrate_dict(old))
    assert (cfg.parallel.dispatch, cfg.parallel.recv_buffer_factor, cfg.parallel.sequence_parallel) == (
        "rbd",
        1.5,
        True,
    )
    assert "dispatch" in old["model"]["moe"]  # the input is left as it was


# values that used to pass validation and then crash or stop on a non-finite loss (issue 23, 2.8)
@pytest.mark.parametrize(
    "override, field",
    [
        ("model.head_dim=0", "model.head_dim=0 must be >= 1"),
        ("model.head_dim=-16", "model.head_dim=-16 must be >= 1"),
        ("model.moe.capacity_factor=.inf", "model.moe.capacity_factor=inf must be a finite number"),
        ("model.init_std=.nan", "model.init_std=nan must be a finite number"),
        ("model.moe.aux_loss_weight=.nan", "model.moe.aux_loss_weight=nan must be a finite number"),
        ("model.rope_theta=-1", "model.rope_theta=-1.0 must be > 0"),
        ("optimizer.lr=inf", "optimizer.lr=inf must be a finite number"),
        ("optimizer.eps=0", "optimizer.eps=0.0 must be > 0"),
        ("model.norm_eps=-1e-6", "model.norm_eps=-1e-06 must be > 0"),
        ("model.moe.z_loss_weight=-0.1", "model.moe.z_loss_weight=-0.1 must be >= 0"),
        ("model.rope_scaling={mscale: .inf}", "model.rope_scaling.mscale=inf must be a finite number"),
        ("train.seed=-1", "train.seed=-1 must be >= 0"),
        ("optimizer.decay_steps=0", "optimizer.decay_steps=0 must be >= 1"),
        ("eval.holdout=.nan", "eval.holdout"),
    ],
)
def test_numbers_that_cannot_train_are_refused(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(TINY, [override])


def test_cli_refuses_an_infinite_learning_rate_before_compiling(capsys) -> None:
    from xmoe_jax.cli import train_main

    assert train_main(["--config", str(TINY), "--set", "optimizer.lr=inf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer.lr=inf must be a finite number" in err[0]


def test_removed_offload_policy_is_refused_with_its_reason():
    """offload_experts trained a different model on an H100 (benchmarks/memory.md): a config naming it
    stops with the reason and the policy to use instead, not a bare 'not one of'."""
    from xmoe_jax.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=r"offload_experts was removed.*save_exchange"):
        ModelConfig(remat="offload_experts")


def test_the_cli_refuses_the_removed_offload_policy_with_its_reason(tmp_path, capsys) -> None:
    """Issue 38: through the CLI (`--set` or a YAML file) loading refused it first, with the bare
    list of choices: the reason and the save_exchange fix never reached a user."""
    from xmoe_jax.cli import train_main

    yaml_file = tmp_path / "offload.yaml"
    yaml_file.write_text(TINY.read_text().replace("model:\n", "model:\n  remat: offload_experts\n", 1))
    for argv in (
        ["--config", str(TINY), "--set", "model.remat=offload_experts"],
        ["--config", str(yaml_file)],
    ):
        assert train_main([*argv, "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.remat=offload_experts was removed" in err[0], err
        assert "use model.remat=save_exchange" in err[0] and "not one of" not in err[0]
    assert not (tmp_path / "run").exists()


def test_the_default_dispatch_is_the_product_path() -> None:
    """Issue 37 section 1: `auto`, the default, is pft wherever the model has routed experts (the
    built-in config behind xmoe-train, the tiny configs); `dense` stays the oracle, by name."""
    from xmoe_jax.config import Config, ParallelConfig
    from xmoe_jax.moe.layer import DEFAULT_PARALLEL

    assert ParallelConfig().dispatch == "auto" and Config().parallel.dispatch == "pft"
    assert load_config(None).parallel.dispatch == "pft"  # xmoe-train with no --config
    for path in CONFIG_FILES:
        if path.stem.startswith("tiny"):
            assert load_config(path).parallel.dispatch == "pft", path.name
    assert load_config(TINY, ["parallel.dispatch=dense"]).parallel.dispatch == "dense"
    assert DEFAULT_PARALLEL.dispatch == "dense"  # moe_layer called bare: the oracle


def test_remat_modes_are_none_and_the_policies() -> None:
    import typing

    from xmoe_jax import remat
    from xmoe_jax.config.choices import RematMode

    assert typing.get_args(RematMode) == ("none", *remat.POLICIES) == remat.REMAT_MODES
