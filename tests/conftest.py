"""Fakes 8 CPU devices before JAX is imported, so mesh tests run on one host; skips `gpu` tests off-GPU."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where JAX's default backend is a GPU; elsewhere they are skipped."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax
    import pytest

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"gpu test: JAX's default backend is {backend!r}, not 'gpu'")
    for item in gpu_items:
        item.add_marker(skip)
