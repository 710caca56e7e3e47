"""One root for every error: each class derives from `XmoeError` and carries the tools' exit status
(2 bad input, 1 failed while running), and the CLI's one wrapper turns any of them into its line
and status. Also: loading a config imports no JAX (the CLI relies on it)."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

from xmoe_jax import cli
from xmoe_jax.errors import ConfigError, XmoeError

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "xmoe_jax"

# every exception class in the package and the exit status it means; a new one must be added here
EXIT_CODES = {
    "ConfigError": 2,
    "UnknownKeyError": 2,
    "ConversionError": 2,
    "DistributedError": 2,
    "CheckpointError": 2,
    "DamagedCheckpointError": 2,
    "IntegrityError": 2,
    "CheckpointWriteError": 1,
    "ExportWriteError": 1,
    "TrainingError": 1,
    "TraceError": 2,
    "WriteError": 1,
}
NOT_ERRORS = {"XmoeError": "the root itself", "Preempted": "a stop on request (status 75), not an error"}


def _exception_classes() -> dict[str, type]:
    """Classes of xmoe_jax whose bases are spelled like exceptions (`...Error`, `Exception`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
            if any(b.endswith(("Error", "Exception")) for b in bases):
                module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
                module = module.removesuffix(".__init__")
                found[node.name] = getattr(importlib.import_module(module), node.name)
    return found


def test_every_error_derives_from_the_root_with_its_exit_code():
    classes = _exception_classes()
    assert set(classes) == set(EXIT_CODES) | set(NOT_ERRORS), "add the new error class to EXIT_CODES"
    for name, code in EXIT_CODES.items():
        assert issubclass(classes[name], XmoeError), name
        assert classes[name].exit_code == code, name
    assert not issubclass(classes["Preempted"], XmoeError)
    assert issubclass(ConfigError, ValueError)  # callers that catch ValueError still see it
    assert not issubclass(classes["DistributedError"], ConfigError)


@pytest.mark.parametrize("name", ["ConfigError", "TrainingError", "CheckpointWriteError"])
def test_the_cli_wrapper_prints_one_line_and_returns_the_errors_status(name, capsys):
    error = _exception_classes()[name]

    @cli.command
    def main(argv):
        raise error("what is wrong; the fix")

    assert main([]) == EXIT_CODES[name]
    assert capsys.readouterr().err == "error: what is wrong; the fix\n"


def test_loading_a_config_imports_no_jax():
    code = (
        "import sys, xmoe_jax.config as c; c.load_config('configs/tiny.yaml', ['train.steps=2']); "
        "print(sorted(m for m in ('jax', 'jaxlib', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
