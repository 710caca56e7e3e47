"""Token permutation: `permute` into expert-sorted order and `combine` back."""

from xmoe_jax.kernels.permute.api import combine, permute, token_rows

__all__ = ["combine", "permute", "token_rows"]
