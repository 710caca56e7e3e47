"""Errors the trainer raises while running (input errors are config.ConfigError)."""

from xmoe_jax.errors import EXIT_FAILED, XmoeError


class TrainingError(XmoeError, RuntimeError):
    """The run cannot go on (e.g. a non-finite loss under nan_policy=stop); the message says why and what to do."""

    exit_code = EXIT_FAILED
