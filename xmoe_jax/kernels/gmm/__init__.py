"""Grouped GEMMs: `gmm` (forward, and gmm's input gradient) and `tgmm` (its weight gradient)."""

from xmoe_jax.kernels.gmm.api import gmm, shared_rows, tgmm

__all__ = ["gmm", "shared_rows", "tgmm"]
