"""The GPU extras name JAX's own extras, which pin JAX's PyPI plugin to the jax version: `[rocm]`
is `jax[rocm7-local]` (jax-rocm7-plugin / -pjrt), `[cuda]` is `jax[cuda13]`. Checked against the
installed jax's metadata, so a jax that renames its extras fails here, not on a GPU machine."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

import pytest

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.parametrize("ours, plugin", [("rocm", "jax-rocm7-plugin"), ("cuda", "jax-cuda13-plugin")])
def test_gpu_extra_pins_jaxs_plugin_to_the_jax_version(ours, plugin) -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (requirement,) = extras[ours]
    jax_extra = re.fullmatch(r"jax\[([\w-]+)\]>=[\d.]+", requirement).group(1)
    version = importlib.metadata.version("jax")
    pins = [
        r
        for r in importlib.metadata.requires("jax")
        if r.startswith(plugin) and f'extra == "{jax_extra}"' in r and version in r
    ]
    assert pins, f"jax {version} has no extra {jax_extra!r} pinning {plugin} to {version}"


def test_dev_installs_what_the_data_tests_use() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert "xmoe_jax[data,viz]" in extras["dev"]
    for package in ("pyarrow", "datasets", "matplotlib"):
        importlib.metadata.version(package)  # installed by .[dev]
