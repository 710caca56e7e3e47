"""The peer harness's pure parts (scripts/peers/): the shape MaxText and torchtitan get from an
xmoe_jax config, and the table's MFU and ratios (one FLOPs formula for every system). The runs
themselves need MaxText, torchtitan and a GPU (scripts/bench_peers.sh; CPU dry run in its header)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import peer_shape as shape  # noqa: E402

CONFIG = ROOT / "configs" / "tiny_small_shape.yaml"


def test_peer_shape_is_the_configs_with_equal_flop_gated_experts():
    s = shape.load_shape(CONFIG)
    assert (s.hidden, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (2048, 4, 16, 16, 128)
    assert (s.num_experts, s.top_k, s.expert_hidden, s.vocab_size) == (64, 6, 1408, 50304)
    assert (s.seq_len, s.batch_size, s.tokens_per_step) == (2048, 32, 65536)
    assert s.gated_expert_hidden == 960  # 3 x 960 >= 2 x 1408, the next multiple of 64
    keys = dict(k.split("=", 1) for k in shape.maxtext_overrides(s))
    assert keys["base_moe_mlp_dim"] == "960" and keys["num_experts_per_tok"] == "6"
    assert keys["capacity_factor"] == "-1" and keys["scan_layers"] == "false"
    assert keys["weight_dtype"] == "float32" and keys["dtype"] == "bfloat16"


def test_peer_shape_refuses_a_dense_layer_naming_the_field(tmp_path):
    text = CONFIG.read_text().replace("num_dense_layers: 0", "num_dense_layers: 1")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit, match="model.num_dense_layers"):
        shape.load_shape(bad)


def _write(folder: Path, name: str, result: dict) -> None:
    (folder / name).write_text(json.dumps(result))


def test_table_one_mfu_formula_and_ratios_to_xmoe(tmp_path):
    h100 = "NVIDIA H100 80GB HBM3"
    gib = 2**30
    _write(tmp_path, "xmoe_none.json", {
        "tokens_per_s": 200_000.0, "tokens_per_step": 65536, "device": h100, "overrides": [],
        "peak_bytes_in_use": 60 * gib,
    })  # fmt: skip
    _write(tmp_path, "xmoe_full.json", {
        "tokens_per_s": 180_000.0, "tokens_per_step": 65536, "device": h100,
        "overrides": ["model.remat=full"], "peak_bytes_in_use": 45 * gib,
    })  # fmt: skip
    _write(tmp_path, "maxtext_full.json", {
        "system": "maxtext", "policy": "full", "batch_size": 32, "tokens_per_s": 90_000.0, "device": h100,
        "peak_bytes_in_use": 36 * gib,
    })  # fmt: skip
    _write(tmp_path, "titan_selective.json", {
        "system": "torchtitan", "policy": "selective:op", "batch_size": 32, "tokens_per_s": 100_000.0,
        "device": h100, "max_memory_allocated": 40 * gib, "max_memory_reserved": 48 * gib,
    })  # fmt: skip
    _write(tmp_path, "notes.json", {"something": "else"})  # not a run: ignored
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "peers" / "table.py"), str(tmp_path), "--config", str(CONFIG),
         "--json", str(out / "peers.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["file"]: r for r in json.loads((out / "peers.json").read_text())["rows"]}
    assert set(rows) == {"xmoe_none.json", "xmoe_full.json", "maxtext_full.json", "titan_selective.json"}
    fpt = json.loads((out / "peers.json").read_text())["flops_per_token"]
    for r in rows.values():  # one formula: MFU / tokens/s is the same for every row
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 989e12)
    assert rows["xmoe_none.json"]["batch"] == 32 and rows["xmoe_full.json"]["policy"] == "full"
    assert rows["maxtext_full.json"]["speed_vs_none"] == pytest.approx(0.45)
    assert rows["maxtext_full.json"]["mem_vs_full"] == pytest.approx(0.8)
    assert rows["titan_selective.json"]["mem_vs_full"] == pytest.approx(48 / 45)  # torch: reserved
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("|---") and lines[3].startswith("| xmoe_jax | none |")  # xmoe first
    assert "48.0 reserved" in proc.stdout


def test_table_expert_parallel_rows_per_gpu_against_xmoe_on_as_many_gpus(tmp_path):
    h100 = "NVIDIA H100 80GB HBM3"
    gib = 2**30
    _write(tmp_path, "xmoe_none.json", {
        "tokens_per_s": 200_000.0, "tokens_per_step": 65536, "device": h100, "overrides": [],
        "peak_bytes_in_use": 60 * gib, "num_devices": 1,
    })  # fmt: skip
    _write(tmp_path, "xmoe_ep4.json", {
        "tokens_per_s": 640_000.0, "tokens_per_step": 4 * 65536, "device": h100, "num_devices": 4,
        "overrides": ["mesh.expert=4", "mesh.data=1", "train.batch_size=128"], "peak_bytes_in_use": 50 * gib,
    })  # fmt: skip
    _write(tmp_path, "titan_ep4.json", {
        "system": "torchtitan", "policy": "full", "batch_size": 32, "num_gpus": 4, "ep": 4,
        "tokens_per_s": 320_000.0, "device": h100, "max_memory_allocated": 30 * gib,
        "max_memory_reserved": 40 * gib,
    })  # fmt: skip
    _write(tmp_path, "maxtext_ep4.json", {
        "system": "maxtext", "policy": "full", "batch_size": 32, "num_devices": 4, "ep": 4,
        "tokens_per_s": 480_000.0, "device": h100, "peak_bytes_in_use": 45 * gib,
    })  # fmt: skip
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "peers" / "table.py"), str(tmp_path), "--config", str(CONFIG),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    rows = {r["file"]: r for r in data["rows"]}
    for r in rows.values():  # MFU per GPU, one formula
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] / r["gpus"] * data["flops_per_token"] / 989e12)
    ep = rows["xmoe_ep4.json"]
    assert (ep["gpus"], ep["ep"], ep["batch"], ep["tokens_per_s_per_gpu"]) == (4, 4, 32, 160_000.0)
    assert rows["maxtext_ep4.json"]["speed_vs_ep"] == pytest.approx(0.75)
    assert rows["titan_ep4.json"]["speed_vs_ep"] == pytest.approx(0.5)
    assert rows["titan_ep4.json"]["mem_vs_ep"] == pytest.approx(40 / 50)  # torch: reserved
    assert rows["xmoe_none.json"]["speed_vs_none"] == 1.0  # the one-GPU table is unchanged
    text = proc.stdout
    assert text.index("| xmoe_jax | none |") < text.index("Expert parallel on 4 GPUs")
    assert "| maxtext | full | 4 | 4 | 32 | 120,000 |" in text


def test_wheel_check_names_a_requirement_the_gpu_machine_lacks(tmp_path):
    import zipfile

    import wheel_check

    def wheel(folder: Path, name: str, *requires: str) -> None:
        folder.mkdir(exist_ok=True)
        meta = "\n".join([f"Name: {name}", *(f"Requires-Dist: {r}" for r in requires)])
        with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}-1.0.dist-info/METADATA", meta)

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["jax>=0.10", "tensorboardX>=2.6", "grain"]\n')
    wheel(
        tmp_path / "whl",
        "grain",
        "numpy",
        "array-record; sys_platform != 'win32'",
        "dataclasses; python_version < '3.7'",
    )
    wheel(tmp_path / "peers", "torchtitan", "datasets>=2.21", "tyro", "pytest; extra == 'dev'")
    gaps = wheel_check.missing([tmp_path / "whl", tmp_path / "peers"], pyproject)
    # tensorboardX: in no wheel, not in the image (the bare-machine failure); datasets: stubbed
    assert gaps == {"xmoe_jax (pyproject.toml)": ["tensorboardx"], "grain": ["array-record"],
                    "torchtitan": ["tyro"]}  # fmt: skip
    wheel(tmp_path / "whl", "tensorboardX", "numpy", "protobuf>=3.20")
    wheel(tmp_path / "whl", "array_record")
    wheel(tmp_path / "peers", "tyro")
    assert wheel_check.missing([tmp_path / "whl", tmp_path / "peers"], pyproject) == {}
    assert wheel_check.main([str(tmp_path / "peers"), "--pyproject", str(pyproject)]) == 1  # no tensorboardX


def _top_level_imports(package: Path) -> set[str]:
    import ast

    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_no_stub_is_named_as_a_package_xmoe_jax_imports():
    """Issue 37: scripts/peers/stubs/datasets made `import datasets` (xmoe_jax's HuggingFace sources)
    resolve to the stub in a map of the repository's imports; it is hf_datasets now."""
    stubs = {p.name for p in (ROOT / "scripts" / "peers" / "stubs").iterdir() if p.is_dir()}
    assert "hf_datasets" in stubs and "datasets" in _top_level_imports(ROOT / "xmoe_jax")
    assert not stubs & _top_level_imports(ROOT / "xmoe_jax")


def test_the_datasets_stub_stands_in_only_where_datasets_is_missing(monkeypatch):
    import wheel_check

    assert "datasets" in wheel_check.stubbed()
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "peers" / "stubs"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    monkeypatch.delitem(sys.modules, "datasets.distributed", raising=False)
    import titan_run

    titan_run.stub_datasets()
    from datasets.distributed import split_dataset_by_node

    assert sys.modules["datasets"].__name__ == "hf_datasets"
    with pytest.raises(RuntimeError, match="stubbed"):
        split_dataset_by_node()
