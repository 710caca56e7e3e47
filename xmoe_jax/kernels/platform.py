"""What this machine is, as the kernel backends need to know it: platform, GPU generation, packages.

Every answer is a static fact (the default JAX backend, the first device, an installed
module), cached after the first call, so backend choice at trace time costs nothing.
"""

from __future__ import annotations

import functools
import importlib.util

import jax


@functools.cache
def platform() -> str:
    """'cpu', 'cuda', 'rocm', or another jax backend name (e.g. 'tpu')."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def interpret() -> bool:
    """Pallas kernels run in interpret mode off-GPU."""
    return platform() not in ("cuda", "rocm")


@functools.cache
def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def is_hopper() -> bool:
    if platform() != "cuda":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
