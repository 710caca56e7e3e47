"""`train.stop_signals` read as signal names: checked when the config is, used by the trainer's
stop (`train/preemption.py`). Here, under config/, so that validating a config imports nothing of
train/ (and no JAX: the CLI sets JAX's flags after loading the config)."""

from __future__ import annotations

import signal

from xmoe_jax.errors import ConfigError


def stop_signal_names(text: str) -> list[str]:
    """`train.stop_signals` ("SIGTERM,INT,...", "" = none) as signal names; ConfigError if one is not
    a signal a process can catch."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    names = [n if n.startswith("SIG") else f"SIG{n}" for n in names]
    for n in names:
        if n not in signal.Signals.__members__ or n in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(
                f"train.stop_signals: {n} is not a signal a process can catch; list names such as "
                "SIGTERM,SIGINT,SIGUSR1 (or '' for none)"
            )
    return names
