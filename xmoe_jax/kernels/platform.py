"""What this machine is, as the kernel backends need to know it: platform, GPU generation, packages.

Every answer is a static fact (the default JAX backend, the first device, an installed
module), cached after the first call, so backend choice at trace time costs nothing.

`target(name)` makes the backend choice follow an explicit platform instead of this
machine's: under `with target("rocm"):` a CPU host traces the ROCm program (Pallas kernels
through their Triton lowering, not interpret mode; Pallas flash attention), which
`jax.export(..., platforms=["rocm"])` then lowers (perf/lowering.py). Trace a freshly built
function inside the block: a program already traced for this machine keeps its choices.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Iterator

import jax

GPU_PLATFORMS = ("cuda", "rocm")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("xmoe_target_platform", default=None)


@functools.cache
def runtime_platform() -> str:
    """This machine's platform: 'cpu', 'cuda', 'rocm', or another jax backend name (e.g. 'tpu')."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def platform() -> str:
    """The platform kernels are chosen for: the `target` in force, else this machine's."""
    return _TARGET.get() or runtime_platform()


@contextlib.contextmanager
def target(name: str) -> Iterator[None]:
    """Choose kernels for platform `name` ('cuda', 'rocm' or 'cpu') while the block runs."""
    if name not in (*GPU_PLATFORMS, "cpu"):
        raise ValueError(f"target platform must be one of {(*GPU_PLATFORMS, 'cpu')}, got {name!r}")
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


def interpret() -> bool:
    """Pallas kernels run in interpret mode off-GPU."""
    return platform() not in GPU_PLATFORMS


@functools.cache
def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_hopper() -> bool:
    """An NVIDIA Hopper (or later) GPU is the target: False for a cuda target traced on a CPU host
    (no device to ask), so Mosaic GPU kernels fall back to Pallas there."""
    return platform() == "cuda" and _first_device_is_hopper()


@functools.cache
def _first_device_is_hopper() -> bool:
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
