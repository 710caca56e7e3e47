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


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drops JAX's compiled programs after each test module. XLA:CPU maps every JIT-compiled
    kernel into its own memory regions (code, constants, data) and frees them only with the
    executable; the whole suite in one process kept ~60,000 of them alive and crashed in XLA
    (SIGSEGV / abort) at Linux's default vm.max_map_count of 65,530."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


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


@pytest.fixture(autouse=True)
def _stop_signals_put_back():
    """An in-process `xmoe-train` that stopped leaves the stop signals ignored (right for a process
    about to exit); a later test and the children it starts would inherit that. Put them back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)
