"""The import map keeps its lattice: config/ is below train/, and train/ has no import circle.

Read with `ast` (no imports run, nothing compiles); an import inside a function counts too, since a
circle closed lazily is still a circle a reader must hold in mind.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "xmoe_jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the xmoe_jax modules it imports (`from pkg import mod` resolves to `pkg.mod`)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]], within: str) -> list[str] | None:
    """One import circle among the modules under `within`, or None."""
    nodes = {m for m in graph if m.startswith(within + ".")}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m] & nodes):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_config_imports_nothing_of_train():
    graph = _graph()
    offenders = {m: sorted(n for n in deps if n.startswith("xmoe_jax.train")) for m, deps in graph.items()}
    assert not {m: v for m, v in offenders.items() if m.startswith("xmoe_jax.config") and v}


def test_train_has_no_import_circle():
    graph = _graph()
    assert len([m for m in graph if m.startswith("xmoe_jax.train.")]) > 10
    assert _cycle(graph, "xmoe_jax.train") is None


def test_the_circle_finder_finds_a_circle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert _cycle(graph, "p") == ["p.a", "p.b", "p.c", "p.a"]
    assert _cycle({"p.a": {"p.b"}, "p.b": set()}, "p") is None


def test_config_has_no_import_circle():
    """config/applies.py reads `Config` from run.py, and run.py imports nothing of applies.py (issue 37)."""
    graph = _graph()
    assert "xmoe_jax.config.run" in graph["xmoe_jax.config.applies"]
    assert _cycle(graph, "xmoe_jax.config") is None


def test_the_kernels_cite_only_files_that_exist():
    """Issue 37: kernels/backends.py named a gmm/fp8_api.py the repository does not hold. Every `x/y.py`
    path in xmoe_jax/kernels/ resolves from the kernels folder, the package or the repository root."""
    import re

    kernels = PACKAGE / "kernels"
    roots = (kernels, PACKAGE, PACKAGE.parent)
    missing = []
    for path in kernels.rglob("*.py"):
        for cited in re.findall(r"\b[\w/]+/\w+\.py\b", path.read_text()):
            if not any((root / cited).is_file() for root in roots):
                missing.append(f"{path.relative_to(PACKAGE.parent)}: {cited}")
    assert not missing
