"""The push exchange: rows written straight into peers' receive buffers (api.py)."""

from xmoe_jax.kernels.push.api import gmm_push, push_gmm, push_rows

__all__ = ["gmm_push", "push_gmm", "push_rows"]
