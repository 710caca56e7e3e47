"""`examples/`: each file runs as the README shows it, and prints what the README says.

`examples/moe_layer.py` is the README's "The MoE core" snippet (the part between its `README`
marks is the README's block, character for character) plus the capacity semantics the README
states: dropless every mode agrees; dropping, dense and padded share one capacity for the batch
while pft and rbd count it per source shard, and agree with dense on one token shard.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "moe_layer.py"


def _readme_block(heading: str, lang: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)[0]


def test_readme_moe_core_block_is_the_example() -> None:
    source = EXAMPLE.read_text()
    marked = source.split("# README begin\n")[1].split("# README end\n")[0]
    shown = "\n".join(line.replace("  # noqa: E402", "") for line in marked.splitlines()) + "\n"
    assert _readme_block("The MoE core", "python") == shown


def test_readme_moe_core_block_sets_its_devices_before_jax_starts() -> None:
    """Issue 31: the 8-fake-device line sat above the README mark, so the block pasted alone on a CPU
    crashed at MeshConfig(expert=8) (one device)."""
    block = _readme_block("The MoE core", "python")
    assert block.index("xla_force_host_platform_device_count=8") < block.index("import jax")


@pytest.mark.slow  # ~20 s: one pft compile on 8 fake devices
def test_readme_moe_core_block_runs_pasted_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a plain shell: no fake devices
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    code = _readme_block("The MoE core", "python") + "print(float(abs(y_pft_TD - y_TD).max()))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-5, out.stdout


@pytest.mark.slow  # ~30 s; the README block's identity with the file stays in the default run
def test_moe_layer_example_runs_and_shows_the_capacity_semantics() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert float(lines[0].split("= ")[1]) < 1e-5, lines  # dropless: pft == dense
    rows = re.findall(
        r"^  (\w+ on [\w ]+): dropped (\d+) \(dense: (\d+)\), max \|diff\| vs dense = (\S+)$",
        out.stdout,
        re.M,
    )
    got = {name: (int(dropped), int(ref), float(diff)) for name, dropped, ref, diff in rows}
    assert len(got) == 4, out.stdout
    for same in ("padded on 8 devices", "pft on one token shard"):  # one capacity for the same tokens
        dropped, ref, diff = got[same]
        assert dropped == ref and diff < 1e-5, (same, out.stdout)
    dropped, ref, diff = got["pft on 8 devices"]  # capacity per source shard: other copies dropped
    assert dropped > ref and diff > 1e-3, out.stdout
    assert got["rbd on 8 devices"][:2] == got["pft on 8 devices"][:2], out.stdout
