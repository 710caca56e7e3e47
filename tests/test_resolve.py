"""xmoe_jax/resolve.py: placement settled once at start-up; dispatch modes asked, not named.

No compiles: configs in, configs out.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest

from xmoe_jax import resolve
from xmoe_jax.config import ParallelConfig, load_config
from xmoe_jax.launch import xla_flags
from xmoe_jax.moe.dispatchers import DISPATCHERS, exchanges_tokens
from xmoe_jax.moe.transports import choose
from xmoe_jax.resolve import ONE_DEVICE, one_device_overrides, resolve_parallel, resolve_placement


def _cfg(*overrides):
    return load_config("configs/tiny.yaml", list(overrides))


def test_auto_transport_becomes_concrete_for_the_backend():
    assert resolve_placement(_cfg(), 1).parallel.transport == "emulated"  # CPU
    assert resolve_placement(_cfg(), 1, backend="gpu").parallel.transport == "bucketed"
    ragged = _cfg("parallel.dispatch=pft", "mesh.expert=2", "parallel.transport=ragged")
    assert resolve_placement(ragged, 2, backend="gpu").parallel.transport == "ragged"


def test_adaptive_dropless_exchange_starts_on_the_first_rung():
    pft = _cfg("parallel.dispatch=pft")
    assert pft.parallel.recv_buffer_factor is None
    assert resolve_placement(pft, 8).parallel.recv_buffer_factor == 1.2  # moe/ladder.py's DEFAULT_START
    assert resolve_placement(pft, 1).parallel.recv_buffer_factor is None  # no exchange: no ladder
    fixed = _cfg("parallel.dispatch=pft", "mesh.expert=8", "parallel.adaptive_buffers=false")
    assert resolve_placement(fixed, 8).parallel.recv_buffer_factor is None
    assert resolve_placement(_cfg("parallel.dispatch=dense"), 8).parallel.recv_buffer_factor is None


def test_resolving_twice_changes_nothing_and_keeps_the_rest():
    cfg = _cfg("parallel.dispatch=rbd", "parallel.overlap_chunks=2")
    once = resolve_placement(cfg, 8)
    assert resolve_placement(once, 8) == once
    assert dataclasses.replace(once, parallel=cfg.parallel) == cfg


def test_moe_resolves_transport_without_reading_xla_flags(monkeypatch):
    def no_flags(*_):
        raise AssertionError("moe/ read the XLA flags")

    monkeypatch.setattr(xla_flags, "effective_flags", no_flags)
    monkeypatch.setattr(xla_flags, "transport_for", no_flags)
    assert choose("auto").name == "emulated"
    assert choose("auto", "cuda").name == "bucketed"
    assert choose("ragged", "cuda").name == "ragged"


def test_resolve_records_whether_the_ragged_exchange_is_decomposed(monkeypatch):
    for preset, decomposed in (("decomposer", True), ("default", False), ("sendrecv", False)):
        monkeypatch.setattr(xla_flags, "effective_preset", lambda preset=preset: preset)
        for backend in ("cpu", "gpu"):
            assert resolve_placement(_cfg(), 1, backend=backend).parallel.ragged_decomposed is decomposed
        assert resolve_parallel(ParallelConfig(transport="ragged")).ragged_decomposed is decomposed
    assert ParallelConfig().ragged_decomposed is False  # unresolved: moe/ assumes XLA's own kernel


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def test_moe_package_does_not_import_xla_flags():
    """Placement facts reach moe/ through the resolved config (xmoe_jax/resolve.py), not XLA flags."""
    files = sorted((Path(__file__).parents[1] / "xmoe_jax" / "moe").rglob("*.py"))
    assert len(files) > 10
    offenders = {
        f.name: sorted(n for n in _imports(f) if "xla_flags" in n or n.startswith("xmoe_jax.launch"))
        for f in files
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_one_device_is_a_named_placement():
    cfg = _cfg(*one_device_overrides(), "parallel.dispatch=pft")  # the user's overrides come after
    assert (cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor, cfg.mesh.expert_nodes) == (1, 1, 1, 1)
    assert not cfg.mesh.fsdp and cfg.parallel.dispatch == "pft"
    assert {f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)} < set(ONE_DEVICE)


def test_one_device_takes_a_run_whose_switches_need_its_mesh():
    """A pft run with ragged transport, tensor switches and FP8 dispatch: none of those can apply on
    one device (config/applies.py refuses them), so ONE_DEVICE resets them all: the default placement,
    its `auto` dispatch settled to pft."""
    run = ["mesh.expert=4", "mesh.tensor=2", "parallel.dispatch=pft", "parallel.transport=ragged",
           "parallel.ssmb=true", "parallel.recv_buffer_factor=1.5", "model.fp8={dispatch: true}"]  # fmt: skip
    assert _cfg(*run).parallel.ssmb
    cfg = _cfg(*run, *one_device_overrides())
    assert cfg.parallel == ParallelConfig(dispatch="pft") and cfg.model.fp8 is None and cfg.mesh.tensor == 1


@pytest.mark.parametrize("dispatch", sorted(DISPATCHERS))
def test_the_dispatcher_table_says_which_modes_exchange_tokens(dispatch):
    assert exchanges_tokens(dispatch) == (dispatch in ("pft", "rbd"))
    assert exchanges_tokens(ParallelConfig(dispatch=dispatch).dispatch) == DISPATCHERS[dispatch].shard_map


def test_the_dense_oracle_beyond_a_toy_size_warns_once_with_its_memory(caplog, monkeypatch):
    """Issue 37 section 1: `dispatch: dense` runs every expert on every token; a run that asks for
    it with more than a toy number of experts or tokens is told, once, what that costs."""
    monkeypatch.setattr(resolve, "_warned", set())
    toy = _cfg("parallel.dispatch=dense")
    many_experts = _cfg("parallel.dispatch=dense", "model.moe.num_experts=64")
    many_tokens = _cfg("parallel.dispatch=dense", "train.batch_size=256", "model.max_seq_len=128",
                       "train.seq_len=128")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="xmoe_jax"):
        resolve_placement(toy, 1)
        resolve_placement(_cfg("model.moe.num_experts=64"), 1)  # pft: no warning
        for _ in range(2):
            resolve_placement(many_experts, 1)
    warned = [r.getMessage() for r in caplog.records if "oracle" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "all 64 experts" in warned[0] and "MiB" in warned[0] and "parallel.dispatch=auto" in warned[0]
    assert "32768 tokens" in resolve.warn_dense_oracle(many_tokens, 1)
