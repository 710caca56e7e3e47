"""Fakes 8 CPU devices before JAX is imported, so mesh tests run on one host; skips `gpu` tests
off-GPU; fixtures shared by the tests that run the CLI in subprocesses (tests/clirun.py)."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()


import pytest  # noqa: E402  (after XLA_FLAGS: nothing here may start JAX earlier)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where JAX's default backend is a GPU; elsewhere they are skipped."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"gpu test: JAX's default backend is {backend!r}, not 'gpu'")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One compilation cache for this process and the CLI subprocesses, for a module's tests."""
    import clirun

    with clirun.compile_cache(clirun.session_cache_dir(tmp_path_factory)) as path:
        yield path


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory, compile_cache):
    """(run dir, step -> loss) of an uninterrupted `clirun.tiny_config` run in this process."""
    import clirun

    from xmoe_jax.train.loop import train

    run = tmp_path_factory.mktemp("reference") / "run"
    return run, train(clirun.tiny_config(run)).losses
