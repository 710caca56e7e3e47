"""Fakes 8 CPU devices before JAX is imported, so mesh tests run on one host."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
