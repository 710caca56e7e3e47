"""Every command of the README's "Your data" section, run as written (in a scratch directory
holding the files the section assumes the reader has: documents, a tokenizer.json, a Megatron
dataset). The only additions: `xmoe-train` runs 4 steps (`--set train.steps=4` appended), and the
section's YAML is merged into the copied config, as the section tells the reader to do."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil

import numpy as np
import pytest
import yaml
from data_helpers import documents, train_bpe, write_jsonl

from xmoe_jax.cli import eval_main, plot_main, tokenize_main, train_main
from xmoe_jax.data import load_tokenizer
from xmoe_jax.data.megatron import write_megatron

REPO = pathlib.Path(__file__).resolve().parents[1]
PROGRAMS = {
    "xmoe-tokenize": tokenize_main,
    "xmoe-train": train_main,
    "xmoe-eval": eval_main,
    "xmoe-plot": plot_main,
}
FAST = ["--set", "train.steps=4", "--set", "train.log_every=2"]


def _section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Your data\n")
    return text[start : text.index("\n## ", start + 1)]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def _materials(root: pathlib.Path) -> None:
    """What a reader brings: documents, a tokenizer, a Megatron dataset made with it."""
    docs = documents(3000, seed=11)
    write_jsonl(root / "corpus" / "part-0.jsonl", docs[:1500])
    write_jsonl(root / "corpus" / "part-1.jsonl", docs[1500:2500])
    write_jsonl(root / "more" / "extra.jsonl", docs[2500:])
    train_bpe(docs, root / "tokenizer.json", vocab_size=512)
    tok = load_tokenizer(str(root / "tokenizer.json"))
    (root / "data").mkdir()
    write_megatron(
        root / "data" / "my_text_document", [np.asarray(ids + [tok.eos_id]) for ids in tok.encode_batch(docs)]
    )
    (root / "configs").symlink_to(REPO / "configs")


@pytest.mark.slow  # ~27 s: the README's commands end to end
def test_every_command_in_your_data_runs(tmp_path, monkeypatch, capsys) -> None:
    section = _section()
    (config_yaml,) = _blocks(section, "yaml")
    commands = [line for block in _blocks(section, "bash") for line in block.splitlines() if line.strip()]
    assert len(commands) >= 6
    _materials(tmp_path)
    monkeypatch.chdir(tmp_path)
    for line in commands:
        argv = shlex.split(line, comments=True)
        program, args = argv[0], argv[1:]
        if program == "cp":  # copy the config, then give it the section's data: and eval:
            shutil.copy(*args)
            merged = _merge(yaml.safe_load(pathlib.Path(args[1]).read_text()), yaml.safe_load(config_yaml))
            pathlib.Path(args[1]).write_text(yaml.safe_dump(merged))
            continue
        assert program in PROGRAMS, f"README command {program!r} is not run by this test"
        code = PROGRAMS[program](args + FAST if program == "xmoe-train" else args)
        assert code == 0, (line, capsys.readouterr().err)
    manifest = json.loads((tmp_path / "data" / "corpus" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["vocab_size"] <= 512
    assert (tmp_path / "runs" / "mine" / "plots" / "expert_load.png").is_file()
    for run in ("mine", "mixture"):
        records = [
            json.loads(x) for x in (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records if "eval_loss" in r] == [4], run  # eval at the last step
