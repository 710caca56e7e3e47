"""The README as a newcomer runs it: every command of its Train, Your data, Generation and
HuggingFace sections, in the README's order, in a fresh directory holding a copy of the
repository's tracked files (`git ls-files`), as a clean clone has them.

What the reader brings is made here: the "Your data" documents, a tokenizer.json trained with
`tokenizers`, a Megatron dataset made with it, a valid.jsonl, and a stand-in for the downloaded
HuggingFace model (a tiny random Qwen3-MoE exported by `xmoe-convert`). The only change to the
commands is the one the README's Train section names for shortening runs: `train.steps` (absent:
2 steps; `train.steps=N`: 2 + N // 100, so a `--resume` to a later step still goes further).
Sections left out: Set up and ROCm (pip installs), Training at scale and the DeepSeek section
(`xmoe-plan` compiles full-size models: `tests/test_plan.py`), Multi-node (SLURM; its dry run is
`tests/test_distributed.py`). The MoE core's Python block is `tests/test_examples.py`'s.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import subprocess

import numpy as np
import pytest
import yaml
from data_helpers import documents, train_bpe, write_jsonl

from xmoe_jax.cli import eval_main, params_main, plot_main, tokenize_main, train_main
from xmoe_jax.cli_models import convert_main, generate_main

REPO = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("Train", "Your data", "Checkpoints from and to HuggingFace", "Generation")
PROGRAMS = {
    "xmoe-train": train_main,
    "xmoe-params": params_main,
    "xmoe-tokenize": tokenize_main,
    "xmoe-eval": eval_main,
    "xmoe-plot": plot_main,
    "xmoe-generate": generate_main,
    "xmoe-convert": convert_main,
}
TRAINING = ("xmoe-train", "python -m xmoe_jax.cli")
SHORT = 2  # steps of a training that does not name train.steps


def readme_commands(text: str) -> list[tuple[str, str, str | None]]:
    """(section, command, the section's yaml block or None) in README order, for SECTIONS."""
    out = []
    for section in re.split(r"\n(?=## )", text):
        title = section.split("\n", 1)[0].removeprefix("## ").strip()
        if title not in SECTIONS:
            continue
        yamls = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
            for line in block.splitlines():
                if line.strip():
                    out.append((title, line, yamls[0] if yamls else None))
    return out


def shortened(argv: list[str]) -> list[str]:
    """`train.steps`: N -> 2 + N // 100; absent -> 2 (and every step logged)."""
    out = [
        re.sub(r"^train\.steps=(\d+)$", lambda m: f"train.steps={SHORT + int(m[1]) // 100}", a) for a in argv
    ]
    if not any(a.startswith("train.steps=") for a in out):
        out += ["--set", f"train.steps={SHORT}"]
    return out + ["--set", "train.log_every=1"]


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else value
    return out


def _clone(root: pathlib.Path) -> None:
    """The repository's tracked files, as a clean clone holds them."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the README walkthrough copies `git ls-files`, which failed here ({e})")
    for name in listed.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)


def _materials(root: pathlib.Path) -> None:
    """What a reader brings: documents, a tokenizer, a Megatron dataset made with it, other data
    for xmoe-eval, and a HuggingFace model directory (a tiny random Qwen3-MoE)."""
    from test_hf_convert import MODELS, _run

    from xmoe_jax.data import load_tokenizer
    from xmoe_jax.data.megatron import write_megatron
    from xmoe_jax.hf.convert import export_checkpoint

    docs = documents(3000, seed=11)
    write_jsonl(root / "corpus" / "part-0.jsonl", docs[:1400])
    write_jsonl(root / "corpus" / "part-1.jsonl", docs[1400:2500])
    write_jsonl(root / "more" / "extra.jsonl", docs[2500:2900])
    write_jsonl(root / "valid.jsonl", docs[2900:])
    train_bpe(docs, root / "tokenizer.json", vocab_size=512)
    tok = load_tokenizer(str(root / "tokenizer.json"))
    (root / "data").mkdir(exist_ok=True)
    write_megatron(
        root / "data" / "my_text_document", [np.asarray(ids + [tok.eos_id]) for ids in tok.encode_batch(docs)]
    )
    seed = root.parent / "qwen3_seed"
    _run(MODELS["qwen3_moe"], seed)
    export_checkpoint(seed, root / "path" / "to" / "Qwen3-30B-A3B")  # stands in for a download


def test_commands_parse_into_the_covered_sections() -> None:
    commands = readme_commands((REPO / "README.md").read_text())
    assert {section for section, _, _ in commands} == set(SECTIONS)
    assert shortened(["--set", "train.steps=300", "--resume"])[:2] == ["--set", "train.steps=5"]
    assert shortened(["--config", "x.yaml"])[-4:] == ["--set", "train.steps=2", "--set", "train.log_every=1"]


@pytest.mark.slow  # a few minutes: about ten short trainings, each compiling its step
def test_readme_commands_run_in_order_from_a_clean_copy(tmp_path, monkeypatch, capsys) -> None:
    root = tmp_path / "clone"
    _clone(root)
    _materials(root)
    monkeypatch.chdir(root)
    commands = readme_commands((root / "README.md").read_text())
    programs = []
    for section, line, config_yaml in commands:
        argv = shlex.split(line, comments=True)
        if argv[:3] == ["python", "-m", "xmoe_jax.cli"]:
            argv = ["xmoe-train", *argv[3:]]
        program, args = argv[0], argv[1:]
        programs.append(program)
        if program == "cp":  # copy a config, then give it the section's yaml, as the README says
            shutil.copy(*args)
            merged = _merge(yaml.safe_load(pathlib.Path(args[1]).read_text()), yaml.safe_load(config_yaml))
            pathlib.Path(args[1]).write_text(yaml.safe_dump(merged))
            continue
        assert program in PROGRAMS, f"README ({section}): {program!r} is not run by this test: {line}"
        capsys.readouterr()
        code = PROGRAMS[program](shortened(args) if program == "xmoe-train" else args)
        out = capsys.readouterr()
        assert code == 0, (section, line, out.err[-3000:])
        if program == "xmoe-generate":
            assert "=== 1/" in out.out, (line, out.out)
    assert programs.count("xmoe-train") >= 8 and "xmoe-convert" in programs
    manifest = json.loads((root / "data" / "corpus" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["vocab_size"] <= 512
    mine = yaml.safe_load((root / "runs" / "mine" / "config.yaml").read_text())
    assert mine["data"]["tokenizer"] == "data/corpus/tokenizer"  # the data's own, recorded
    assert (root / "runs" / "mine" / "tokenizer" / "tokenizer.json").is_file()
    assert (root / "runs" / "mine" / "plots" / "expert_load.png").is_file()
    for exported in ("tiny_hf", "qwen3"):
        names = {p.name for p in (root / "exported" / exported).iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names, (exported, names)
