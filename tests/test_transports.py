"""xmoe_jax/moe/transports.py: one record per transport, `auto` settled from it, refusals built from
its facts, and no module outside the table comparing transport names.

No compiles: records, configs and source text.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from xmoe_jax.config import ConfigError, load_config
from xmoe_jax.config.choices import Transport as TransportChoice
from xmoe_jax.launch import xla_flags
from xmoe_jax.moe import transports
from xmoe_jax.moe.transports import AUTO, GPUS, PROCESS_LAYOUTS, TABLE, choose, get, refusal
from xmoe_jax.resolve import resolve_placement

ROOT = Path(__file__).parents[1]
PLATFORMS = ("cpu", "tpu", *GPUS)


def test_the_table_holds_every_transport_the_config_accepts():
    assert set(TABLE) | {AUTO} == set(typing.get_args(TransportChoice))
    assert all(name == t.name for name, t in TABLE.items())


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_record_is_consistent(name):
    t = TABLE[name]
    assert (t.move is None) == (t.layout == "chunked")  # compact layouts move rows through a Plan
    assert t.node_stage().layout == "compact"  # rbd's stage 1 is a ragged exchange
    assert t.ragged_preset is None or t.ragged_preset in xla_flags.RAGGED_A2A_PRESETS
    assert set(t.gpu_processes) <= set(PROCESS_LAYOUTS) and t.gpu_processes
    refused = [(p, n) for p in PLATFORMS for n in PROCESS_LAYOUTS if not t.serves(p, n)]
    if refused:  # a fallback exists, serves where this one cannot and needs none of its own there
        fallback = get(t.fallback)
        assert all(fallback.serves(p, n) for p, n in refused), (name, fallback.name)
    else:
        assert t.fallback is None
    hash(t)  # a static argument of the exchange's custom VJP


def test_auto_picks_bucketed_on_gpu_and_emulated_elsewhere():
    for processes in PROCESS_LAYOUTS:
        assert choose(AUTO, "cuda", processes).name == "bucketed"
        assert choose(AUTO, "rocm", processes).name == "bucketed"
        assert choose(AUTO, "cpu", processes).name == "emulated"
        assert choose(AUTO, "tpu", processes).name == "emulated"
    assert choose(AUTO).name == "emulated"  # this CPU, one process
    assert choose("exact", "cuda", "per_device").name == "exact"  # named: kept (refused elsewhere)
    with pytest.raises(ValueError, match="resolve_parallel"):
        get(AUTO)


def test_refusals_come_from_the_records():
    line = refusal(get("exact"), "cuda", "per_device", 8)
    assert line == (
        "parallel.transport=exact runs XLA's one-shot ragged all-to-all kernel (XLA refuses it across "
        "processes: 'fallback to NCCL is not allowed'), which needs one process driving every GPU; this run "
        "has 8 processes (several processes per host); use parallel.transport=bucketed (or auto)"
    )
    assert refusal(get("exact"), "cpu", "per_device", 8) is None  # CPU: the emulation serves any layout
    assert "this run is on cpu; use parallel.transport=emulated" in refusal(get("ragged"), "cpu", "one")
    assert all(refusal(get(n), "cuda", "one") is None for n in TABLE)


def test_the_trainer_refuses_at_start_up_in_one_line(monkeypatch):
    exact = load_config(
        "configs/tiny.yaml", ["parallel.dispatch=pft", "mesh.expert=2", "parallel.transport=exact"]
    )
    monkeypatch.setattr(transports, "process_layout", lambda: "per_device")
    monkeypatch.setattr(transports.jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError) as err:
        resolve_placement(exact, 2, backend="gpu")
    assert str(err.value) == refusal(get("exact"), "cuda", "per_device", 2) and "\n" not in str(err.value)
    assert resolve_placement(exact, 2).parallel.transport == "exact"  # on CPU: the emulation
    ragged = dataclasses.replace(exact, parallel=dataclasses.replace(exact.parallel, transport="ragged"))
    with pytest.raises(ConfigError, match="parallel.transport=emulated"):
        resolve_placement(ragged, 2)  # XLA:CPU has no ragged all-to-all


def test_a_new_transport_is_one_entry(monkeypatch):
    """A push kernel (CUDA only, one process per host at most, needs a flag): auto takes it where it
    serves and falls back to bucketed elsewhere; refused by name on ROCm or per-device processes."""
    push = transports.Transport(
        "push",
        layout="compact",
        wire="exact",
        move=get("exact").move,
        runs="a Mosaic GPU kernel writing into peers' receive buffers",
        platforms=("cuda",),
        gpu_processes=("one", "per_host"),
        xla_flags=(("xla_gpu_enable_dynamic_slice_fusion", "false"),),
        fallback="bucketed",
        auto_on=("cuda",),
        auto_rank=0,
    )
    monkeypatch.setitem(TABLE, "push", push)
    assert choose(AUTO, "cuda", "one").name == "push" and choose(AUTO, "cuda", "per_host").name == "push"
    assert choose(AUTO, "cuda", "per_device").name == "bucketed"
    assert choose(AUTO, "rocm", "one").name == "bucketed" and choose(AUTO, "cpu", "one").name == "emulated"
    assert refusal(push, "rocm", "one").endswith("which serves cuda only; this run is on rocm; "
                                                 "use parallel.transport=bucketed (or auto)")  # fmt: skip
    assert "use parallel.transport=bucketed" in refusal(push, "cuda", "per_device", 8)
    assert transports.xla_flags(AUTO) == {"xla_gpu_enable_dynamic_slice_fusion": "false"}
    assert transports.xla_flags("bucketed") == {}
    test_each_record_is_consistent("push")


def test_arrival_comes_from_the_record_and_the_env_turns_it_off(monkeypatch):
    """push lands rows grouped by expert (layouts.compact); XMOE_ARRIVAL=source measures the other;
    any other value is refused naming the variable."""
    assert transports.arrival(get("push")) == "expert" and transports.arrival(get("exact")) == "source"
    monkeypatch.setenv(transports.ARRIVAL_ENV, "source")
    assert transports.arrival(get("push")) == "source"
    monkeypatch.setenv(transports.ARRIVAL_ENV, "expert")
    with pytest.raises(ValueError, match="XMOE_ARRIVAL='expert': use source"):
        transports.arrival(get("push"))


def test_push_returns_inside_the_gemm_unless_arrival_or_the_env_says_otherwise(monkeypatch):
    """push's return runs inside the down-projection (its record's gmm_move); not with source-major
    arrival (the rows are not grouped), nor with XMOE_FUSED_RETURN=off; other values are refused."""
    from xmoe_jax.moe.exchange import move_push_gmm

    assert transports.gmm_move(get("push")) is move_push_gmm
    assert transports.gmm_move(get("exact")) is None and transports.gmm_move(get("emulated")) is None
    monkeypatch.setenv(transports.ARRIVAL_ENV, "source")
    assert transports.gmm_move(get("push")) is None
    monkeypatch.delenv(transports.ARRIVAL_ENV)
    monkeypatch.setenv(transports.FUSED_RETURN_ENV, "off")
    assert transports.gmm_move(get("push")) is None
    monkeypatch.setenv(transports.FUSED_RETURN_ENV, "on")
    with pytest.raises(ValueError, match="XMOE_FUSED_RETURN='on': use off"):
        transports.gmm_move(get("push"))


def test_push_runs_the_exchange_before_a_gemm_inside_it_only_when_asked(monkeypatch):
    """push's dispatch and cotangent run with the GEMM after them in one kernel (its record's arrive_gmm)
    only with XMOE_FUSED_ARRIVE=on (not yet measured on a GPU), and only where the return is fused too
    (the rows are grouped); other values are refused."""
    from xmoe_jax.moe.exchange import move_push_arrive

    monkeypatch.delenv(transports.FUSED_ARRIVE_ENV, raising=False)
    assert transports.arrive_gmm(get("push")) is None
    monkeypatch.setenv(transports.FUSED_ARRIVE_ENV, "on")
    assert transports.arrive_gmm(get("push")) is move_push_arrive
    assert transports.arrive_gmm(get("exact")) is None
    monkeypatch.setenv(transports.FUSED_RETURN_ENV, "off")
    assert transports.arrive_gmm(get("push")) is None
    monkeypatch.setenv(transports.FUSED_ARRIVE_ENV, "yes")
    with pytest.raises(ValueError, match="XMOE_FUSED_ARRIVE='yes': use on or off"):
        transports.arrive_gmm(get("push"))


def test_docs_show_the_table():
    assert transports.markdown_table() in (ROOT / "docs" / "exchange.md").read_text()


NAMES = frozenset(typing.get_args(TransportChoice)) - {AUTO}


def _names_in(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def _speaks_of_transports(side: ast.AST, fn: ast.FunctionDef | None, source: str) -> bool:
    """Whether the other side of an `== "auto"` is a transport: it says so, or it is a parameter of a
    function named for transports (`transport_for(requested, ...)`)."""
    if "transport" in (ast.get_source_segment(source, side) or ""):
        return True
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} if fn else set()
    return isinstance(side, ast.Name) and side.id in params and "transport" in fn.name


def _offences(source: str, where: str = "<src>") -> list[str]:
    """Comparisons with a transport name (`auto` too, when the other side is a transport), and dicts
    keyed by transport names (a second table)."""
    found = []
    tree = ast.parse(source)
    owner: dict[ast.AST, ast.FunctionDef] = {}  # node -> its innermost enclosing function
    for fn in ast.walk(tree):  # outer functions come first, so inner ones overwrite them
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner.update({n: fn for n in ast.walk(fn)})
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            names = set().union(*(_names_in(n) for n in sides))
            auto = AUTO in names and any(_speaks_of_transports(n, owner.get(node), source) for n in sides)
            if names & NAMES or auto:
                found.append(f"{where}:{node.lineno}: {ast.get_source_segment(source, node)}")
        elif isinstance(node, ast.Dict):
            keys = set().union(*(_names_in(k) for k in node.keys if k is not None))
            if len(keys & NAMES) >= 2:
                found.append(f"{where}:{node.lineno}: a dict keyed by transport names")
    return found


def test_the_offence_finder_finds_offences():
    src = (
        'a = par.transport == "auto"\nif t in ("exact", "ragged"):\n    pass\nT = {"exact": 1, "ragged": 2}\n'
    )
    assert len(_offences(src)) == 3
    assert len(_offences('def transport_for(name):\n    return 1 if name != "auto" else 2\n')) == 1
    assert _offences('def main(transport):\n    factor = "auto"\n    return factor == "auto"\n') == []
    assert _offences('ok = impl == "auto" or t.layout == "chunked" or t.wire == "padded"\n') == []


def test_nothing_outside_the_table_compares_transport_names():
    table = ROOT / "xmoe_jax" / "moe" / "transports.py"
    files = [p for p in sorted((ROOT / "xmoe_jax").rglob("*.py")) if p != table]
    files += sorted((ROOT / "scripts").glob("*.py"))
    assert len(files) > 100
    offences = [o for p in files for o in _offences(p.read_text(), str(p.relative_to(ROOT)))]
    assert not offences, "\n".join(offences)
