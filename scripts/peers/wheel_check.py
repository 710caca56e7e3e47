"""Does every requirement of what runs on the GPU machine resolve there? The machine has no
internet: what its image lacks (scripts/peers/gpu_image_packages.txt) must come as a wheel
(scripts/peers_wheels.sh fills .whl/ and .whl/peers/) or be stubbed (scripts/peers/stubs).

    python3 scripts/peers/wheel_check.py .whl .whl/peers     # run by scripts/peers_wheels.sh

Checked: xmoe_jax's own dependencies (pyproject.toml [project].dependencies: a missing one fails
every GPU script, as tensorboardX did) and every Requires-Dist of every wheel in the folders, for
CPython 3.12 on Linux, extras left out. Names only, not versions: the image's versions are read on
the machine (`pip show`). Prints what is missing and exits 1, else one line and 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = HERE / "gpu_image_packages.txt") -> set[str]:
    lines = path.read_text().splitlines()
    return {norm(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


# a stub folder named apart from the package it stands in for (so the real package's imports never
# resolve to it): folder -> the package
STANDS_IN_FOR = {"hf_datasets": "datasets"}


def stubbed(stubs: Path = HERE / "stubs") -> set[str]:
    if not stubs.is_dir():
        return set()
    return {norm(STANDS_IN_FOR.get(p.name, p.name)) for p in stubs.iterdir() if p.is_dir()}


def wheel_metadata(wheel: Path) -> tuple[str, list[str]]:
    """(name, Requires-Dist lines) of one wheel."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Name:"))
    reqs = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return name, reqs


def needed(req: str) -> str | None:
    """The normalised name a requirement asks for on the GPU machine, or None (marker false, extra)."""
    r = Requirement(req)
    if r.marker is not None and not r.marker.evaluate(ENV):
        return None
    return norm(r.name)


def missing(folders: list[Path], pyproject: Path | None) -> dict[str, list[str]]:
    """Requirer -> the names it needs that neither the image, the wheels nor the stubs provide."""
    have = image_packages() | stubbed()
    wheels = {}
    for folder in folders:
        for wheel in sorted(folder.glob("*.whl")):
            name, reqs = wheel_metadata(wheel)
            wheels[name] = reqs
            have.add(norm(name))
    if pyproject is not None:
        deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
        wheels = {"xmoe_jax (pyproject.toml)": deps, **wheels}
    out = {}
    for requirer, reqs in wheels.items():
        lacking = sorted({n for n in map(needed, reqs) if n is not None and n not in have})
        if lacking:
            out[requirer] = lacking
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path, help="wheel folders (.whl .whl/peers)")
    p.add_argument("--pyproject", type=Path, default=HERE.parents[1] / "pyproject.toml")
    args = p.parse_args(argv)
    gaps = missing(args.folders, args.pyproject)
    if gaps:
        for requirer, names in gaps.items():
            print(f"missing on the GPU machine: {requirer} needs {', '.join(names)} "
                  "(add the wheel to scripts/peers_wheels.sh, or a stub to scripts/peers/stubs)")  # fmt: skip
        return 1
    n = sum(1 for f in args.folders for _ in f.glob("*.whl"))
    print(f"wheel check: every requirement of xmoe_jax and of the {n} wheels resolves on the GPU machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
