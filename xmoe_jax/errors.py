"""The root of every error xmoe_jax raises on purpose, and the exit status it means.

Each error class derives from `XmoeError` and says with `exit_code` what a command-line tool
exits with when it stops on one (`xmoe_jax/cli.py` prints `error: <message>` and returns it):
  - 2 (`EXIT_BAD_INPUT`): bad input, found before or while reading it (a config, a data file, a
    run directory, a checkpoint, a launch setting); the message names the field or file and the fix;
  - 1 (`EXIT_FAILED`): the work failed while running (a non-finite loss, a checkpoint that could
    not be written).
The classes live beside the code that raises them (`ConfigError` here, as everything reads
configs); `tests/test_errors.py` finds them all and checks each one's root and status.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class XmoeError(Exception):
    """An error xmoe_jax raises on purpose; `exit_code` is the tools' exit status for it."""

    exit_code: int = EXIT_FAILED


class ConfigError(XmoeError, ValueError):
    """A configuration value is invalid; the message names the field and the fix. A ValueError
    too, so callers that catch ValueError still see it."""

    exit_code = EXIT_BAD_INPUT
