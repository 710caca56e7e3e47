"""Token permutation: `permute` into expert-sorted order and `combine` back."""

from xmoe_jax.kernels.permute.api import combine, permute

__all__ = ["combine", "permute"]
