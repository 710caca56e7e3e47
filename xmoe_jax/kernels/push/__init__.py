"""The push exchange: rows written straight into peers' receive buffers (api.py)."""

from xmoe_jax.kernels.push.api import push_rows

__all__ = ["push_rows"]
