"""Errors the trainer raises while running (input errors are config.ConfigError)."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss under nan_policy=stop); the message says why and what to do."""
