"""Malformed YAML and duplicate keys (issue 23 2.6): one line naming the file, line and column (or
the override), status 2; never a traceback, never a section silently dropped."""

from __future__ import annotations

import pathlib

import pytest

from xmoe_jax.cli import params_main
from xmoe_jax.config import ConfigError, load_config

GOOD = "model:\n  hidden: 64\ntrain:\n  steps: 3\n"


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("model:\n  hidden: [64\ntrain:\n  steps: 3\n", ":3:", "expected ',' or ']'"),
        ("model:\n\thidden: 64\n", ":2:1:", "not tabs"),
        (
            "model:\n  hidden: 64\ntrain:\n  steps: 3\ntrain:\n  seed: 1\n",
            ":5:1:",
            "key 'train' appears twice",
        ),
        (
            "model:\n  hidden: 64\n  hidden: 32\n",
            ":3:3:",
            "key 'hidden' appears twice in one mapping (first on line 2)",
        ),
    ],
    ids=["unclosed-bracket", "tab", "duplicate-section", "duplicate-key"],
)
def test_malformed_yaml_file_is_one_line_with_line_and_column(tmp_path, capsys, text, where, problem):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"config file {path}{where}") and problem in msg and "\n" not in msg
    assert params_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_file_that_is_not_utf8_names_the_byte(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD.encode() + "# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {path}:5: not UTF-8 text \(byte 0xe9 at offset"):
        load_config(path)


def test_malformed_override_value_names_it(capsys) -> None:
    with pytest.raises(ConfigError, match=r"--set model.hidden=\[64: not a valid YAML value at column"):
        load_config(None, ["model.hidden=[64"])
    assert params_main(["--set", "model.hidden=[64"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert load_config(None, ["model.hidden=64"]).model.hidden == 64  # well-formed ones still parse


def test_well_formed_files_still_load(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(GOOD + "optimizer: {lr: 1.0e-3}\n")
    cfg = load_config(path)
    assert (cfg.model.hidden, cfg.train.steps, cfg.optimizer.lr) == (64, 3, 1.0e-3)


def test_a_typod_key_names_the_file_line_column_and_the_key_meant(tmp_path, capsys) -> None:
    """Issue 37 3.8: `stpes:` was refused with the valid keys only: no file, line or suggestion."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden: 64\ntrain:\n  seed: 1\n  stpes: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(
        f"config file {path}:5:3: unknown config key train.stpes; did you mean train.steps?"
    )
    assert "valid keys under 'train'" in msg and "\n" not in msg
    assert params_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ":5:3:" in err
    path.write_text("modle:\n  hidden: 64\n")  # a section: the top level's keys
    with pytest.raises(ConfigError, match=rf"{path}:1:1: unknown config key modle; did you mean model\?"):
        load_config(path)


def test_a_typod_override_names_the_flag_and_the_key_meant(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.moe.topk=2"])
    msg = str(e.value)
    assert msg.startswith("--set model.moe.topk=2: unknown config key model.moe.topk; did you mean")
    assert "model.moe.top_k?" in msg and str(path) not in msg
    with pytest.raises(ConfigError) as e:  # nothing close: no guess, the valid keys still listed
        load_config(None, ["train.zzzzzz=1"])
    assert "did you mean" not in str(e.value) and "valid keys under 'train'" in str(e.value)
