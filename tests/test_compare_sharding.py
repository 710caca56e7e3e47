"""scripts/compare_sharding.py and xmoe_jax.perf.compare on 8 fake CPU devices (compile-time columns).

Tiny shapes (T=128 tokens, D=16, E=8, top-2) on a (data 2, expert 2, tensor 2) mesh; each
variant compiles once.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import sys

import pytest

from xmoe_jax.config import MeshConfig, MoEConfig
from xmoe_jax.perf import compare
from xmoe_jax.sharding import make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, capacity_factor=1.25)


@functools.cache
def _rows():
    mesh = make_mesh(MeshConfig(data=2, expert=2, tensor=2))
    return compare.compare(CFG, 16, 128, mesh)


def test_table_has_every_variant_and_the_expected_columns() -> None:
    rows = _rows()
    assert [r["variant"] for r in rows] == list(compare.DEFAULT_VARIANTS)
    text = compare.table(rows)
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    assert header == list(compare.COLUMNS)
    assert len(text.splitlines()) == 2 + len(rows)
    for r in rows:
        for key in ("temp_bytes", "argument_bytes", "peak_bytes", "collective_bytes", "collectives"):
            assert key in r, (r["variant"], key)
        assert r["temp_bytes"] > 0
        assert r.get("step_ms") is None  # no timing on CPU
    json.dumps(compare.jsonable(rows))


def test_readings_match_the_variants() -> None:
    rows = {r["variant"]: r for r in _rows()}
    for name in ("pft+ssmb", "pft", "pft+etp"):  # manual: the exchange is an all-to-all over expert
        assert rows[name]["placement"] == "manual"
        assert rows[name]["collectives"]["all-to-all"]["count"] > 0
        assert rows[name]["model_bytes"] > 0
    assert "all-to-all" not in rows["pft-auto"]["collectives"]  # the partitioner gathers instead
    assert rows["pft+ssmb"]["temp_bytes"] < rows["pft"]["temp_bytes"]  # SSMB: 1/TP of the tokens
    assert rows["padded-auto"]["model_bytes"] > 0 and rows["pft-auto"]["model_bytes"] is None


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "compare_sharding", ROOT / "scripts" / "compare_sharding.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~15 s; the table's variants and columns stay in the default run
def test_script_prints_the_table_last_and_writes_json(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "cmp.json"
    argv = [
        "compare_sharding.py",
        "--config", str(ROOT / "configs" / "tiny.yaml"),
        "--set", "mesh.expert=2", "--set", "mesh.tensor=2", "--set", "parallel.dispatch=pft",
        "--tokens", "128", "--variants", "pft+ssmb,padded-auto", "--model-layers", "1",
        "--out", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    _load_script().main()
    lines = capsys.readouterr().out.strip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert lines[-len(table) :] == table and len(table) == 2 + 4  # 2 variants x (layer, model)
    data = json.loads(out.read_text())
    assert data["setup"]["mesh"] == {"data": 2, "expert_node": 1, "expert": 2, "tensor": 2}
    assert {(r["variant"], r["scope"]) for r in data["rows"]} == {
        (v, s) for v in ("pft+ssmb", "padded-auto") for s in ("layer", "model")
    }
    assert "device" in data["environment"]


def test_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        compare.compare(CFG, 16, 128, make_mesh(MeshConfig(data=2, expert=2, tensor=2)), variants=("nope",))
