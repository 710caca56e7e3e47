"""Fakes 8 CPU devices before JAX is imported, so mesh tests run on one host; fixtures shared by
the tests that run the CLI in subprocesses (tests/clirun.py)."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()


import pytest  # noqa: E402  (after XLA_FLAGS: nothing here may start JAX earlier)


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
