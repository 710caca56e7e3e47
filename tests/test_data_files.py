"""Damaged data and weight files (issue 23 2.7): a .jsonl that is not UTF-8, a corrupt .parquet,
a truncated or garbled model.safetensors: one line naming the file, status 2, for xmoe-train,
xmoe-tokenize and xmoe-convert import alike (a non-JSON line was already handled)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xmoe_jax.cli import tokenize_main, train_main
from xmoe_jax.cli_models import convert_main
from xmoe_jax.hf import safetensors_io as st

GOOD = '{"text": "hello world"}\n'


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def bad_files(tmp_path):
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(GOOD.encode() + '{"text": "caf\xe9"}\n'.encode("latin-1"))
    parquet = tmp_path / "corrupt.parquet"
    parquet.write_bytes(b"PAR1" + bytes(range(256)) * 4 + b"PAR1")
    return {
        "jsonl": (latin, f"{latin}:2 is not UTF-8 text (byte 0xe9"),
        "parquet": (parquet, f"{parquet} is not a readable parquet file"),
    }


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_tokenize_names_the_damaged_file(bad_files, kind, tmp_path, capsys):
    path, message = bad_files[kind]
    code = tokenize_main(["--input", str(path), "--tokenizer", "bytes", "--output", str(tmp_path / "out")])
    assert code == 2 and message in _one_line(capsys)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_train_names_the_damaged_file_before_compiling(bad_files, kind, tmp_path, capsys):
    path, message = bad_files[kind]
    argv = [
        "--set",
        f"train.run_dir={tmp_path / 'run'}",
        "--set",
        f"data.path={path}",
        "--set",
        "train.steps=2",
    ]
    assert train_main(argv) == 2 and message in _one_line(capsys)
    assert not (tmp_path / "run" / "checkpoints").exists()


HF_CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize("damage", ["garbled", "truncated"])
def test_convert_import_names_the_damaged_safetensors(tmp_path, capsys, damage):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF_CONFIG))
    st.write_sharded([("model.embed_tokens.weight", np.ones((64, 32), np.float32))], hf)
    weights = hf / st.SINGLE
    data = weights.read_bytes()
    weights.write_bytes(b"\x07" * len(data) if damage == "garbled" else data[: len(data) // 2])
    assert convert_main(["import", "--hf-dir", str(hf), "--out", str(tmp_path / "run")]) == 2
    err = _one_line(capsys)
    assert str(weights) in err and "truncated or damaged; download it again" in err
