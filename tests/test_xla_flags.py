"""XLA flag defaults: applied before JAX starts (the CLI), one clear warning when applied too late,
and a transport choice that reads the flags the running backend started with."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from xmoe_jax.launch import xla_flags

DECOMPOSER = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(xla_flags, "_warned", set())
    monkeypatch.delenv("XMOE_RAGGED_A2A", raising=False)


def test_effective_preset_reads_the_flags():
    assert xla_flags.effective_preset(DECOMPOSER) == "decomposer"
    assert xla_flags.effective_preset(DECOMPOSER.replace("=true", "=True")) == "decomposer"
    assert (
        xla_flags.effective_preset("--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer")
        == "decomposer"
    )
    assert xla_flags.effective_preset(DECOMPOSER.replace("true", "false")) == "default"
    assert xla_flags.effective_preset("") == "default"


def test_transport_follows_what_took_effect(caplog):
    assert xla_flags.transport_for("emulated", "cpu") == "emulated"
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        # bucketed (auto on GPU, settled in resolve.py) is a dense all-to-all: no XLA flag involved
        assert xla_flags.transport_for("bucketed", "gpu", flags="") == "bucketed"
        assert xla_flags.transport_for("bucketed", "cuda", flags=DECOMPOSER) == "bucketed"
        assert xla_flags.transport_for("ragged", "gpu", flags=DECOMPOSER) == "ragged"
        assert not caplog.records
        assert xla_flags.transport_for("ragged", "gpu", flags="") == "ragged"  # the flag did not apply: warn
        assert xla_flags.transport_for("ragged", "cuda", flags="") == "ragged"  # once
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert DECOMPOSER in warnings[0] and "runs XLA's 'default' ragged all-to-all kernel" in warnings[0]
    assert "apply_defaults() before" in warnings[0] and "export XLA_FLAGS=" in warnings[0]


def test_default_preset_chosen_on_purpose_keeps_ragged_quiet(monkeypatch, caplog):
    monkeypatch.setenv("XMOE_RAGGED_A2A", "default")
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        assert xla_flags.transport_for("ragged", "gpu", flags="") == "ragged"
    assert not caplog.records


def test_late_apply_warns_once_naming_the_flag(monkeypatch, caplog):
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: True)
    monkeypatch.setattr(xla_flags, "_flags_at_start", None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        xla_flags.apply_defaults()
        xla_flags.apply_defaults()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"XLA flag {DECOMPOSER} does not take effect in this process" in warning
    assert "apply_defaults() before anything starts JAX's backend" in warning
    assert DECOMPOSER in os.environ["XLA_FLAGS"]  # still added, for child processes
    assert xla_flags.effective_preset() == "default"  # but the running backend has not got it


def test_flags_applied_before_jax_starts_take_effect():
    code = (
        "import os; from xmoe_jax.launch.xla_flags import apply_defaults, effective_preset; apply_defaults(); "
        "import jax; jax.devices(); print(effective_preset(), flush=True)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XMOE_RAGGED_A2A")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "decomposer" and "does not take effect" not in out.stderr


def test_scheduler_flags_are_known_to_this_xla():
    """XLA aborts on an unknown flag (`--xla_gpu_enable_async_all_to_all` is one since it was removed):
    every flag of the scheduler presets must start a backend (GPU flags parse on CPU too)."""
    flags = " ".join(
        f"--{k}={v}" for preset in xla_flags.SCHEDULER_PRESETS.values() for k, v in preset.items()
    )
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x + 1)(jnp.ones(()))), flush=True)"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr[-2000:]


def test_exact_transport_asks_for_xla_s_one_shot_kernel(monkeypatch, caplog):
    """`exact` feeds XLA's own ragged kernel many updates per peer: the decomposer would pad them, so
    its preset is `default`; an explicit XMOE_RAGGED_A2A still wins, with one warning on GPU."""
    monkeypatch.delenv("XMOE_RAGGED_A2A", raising=False)
    assert xla_flags.wanted_preset(transport="exact") == "default"
    assert xla_flags.wanted_preset(transport="auto") == "default"
    assert xla_flags.wanted_preset(transport="ragged") == "decomposer"
    assert xla_flags.wanted_preset() == "decomposer"
    monkeypatch.setenv("XMOE_RAGGED_A2A", "decomposer")
    assert xla_flags.wanted_preset(transport="exact") == "decomposer"
    decomposer = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
    with caplog.at_level(logging.WARNING, logger="xmoe_jax"):
        assert xla_flags.transport_for("exact", "gpu", flags=decomposer) == "exact"
        assert xla_flags.transport_for("exact", "gpu", flags="") == "exact"
    assert len(caplog.records) == 1 and "parallel.transport=exact" in caplog.records[0].message


def test_a_preset_the_installed_xla_does_not_know_is_refused_naming_the_fix(monkeypatch):
    """jaxlib 0.10's XLA aborts on the send/recv fallback flag ("Unknown flag in XLA_FLAGS", CI's dry
    run of gpu_bench_pft.sh ep2): the preset is refused first, naming the flag and the jax it needs."""
    import jaxlib

    sendrecv = xla_flags.RAGGED_A2A_PRESETS["sendrecv"]
    assert xla_flags.unknown_flags(sendrecv, "0.10.2") == [
        "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback"
    ]
    assert xla_flags.unknown_flags(sendrecv, "0.11.2") == xla_flags.unknown_flags(sendrecv, "0.12.0") == []
    monkeypatch.setattr(jaxlib, "__version__", "0.10.2")
    with pytest.raises(ValueError, match=r"send_recv_fallback.*jaxlib 0\.10\.2.*jax>=0\.11"):
        xla_flags.wanted_preset("sendrecv")
    assert xla_flags.wanted_preset("decomposer") == "decomposer"
    monkeypatch.setattr(jaxlib, "__version__", "0.11.2")
    assert xla_flags.wanted_preset("sendrecv") == "sendrecv"
