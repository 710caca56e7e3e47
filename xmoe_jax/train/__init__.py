"""Training: optimizer, jitted step, loop, checkpoints, metrics."""
