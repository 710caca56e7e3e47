"""Kernels for the MoE hot path, each beside its XLA reference (the oracle and the fallback).

    from xmoe_jax.kernels import gmm, tgmm, permute, combine

    x_sorted_RD = permute(x_TD, dest_A, num_rows)                 # tokens -> expert order
    h_RF        = gmm(x_sorted_RD, w_up_EDF, group_sizes_E)       # grouped GEMM
    y_TD        = combine(y_sorted_RD, dest_A, weights_TK)        # expert order -> tokens

Backends (`implementation=`): "xla", "pallas" (Triton-style Pallas: Triton lowering on CUDA
and ROCm, interpret mode on CPU), "triton" (jax-triton, GPU only), "mgpu" (Mosaic GPU,
Hopper only); None picks the fastest measured one for the platform (dispatch.py). All are
differentiable through custom VJPs and fall back to XLA when they cannot run.

Files: gmm.py / permute.py (public ops, custom VJPs), dispatch.py (backend choice),
validation.py, group_metadata.py (tile -> group work list), gmm_{xla,pallas,triton,mgpu}.py,
permute_{xla,pallas}.py.
"""

from xmoe_jax.kernels.backends import DEFAULT_IMPLEMENTATION, IMPLEMENTATIONS, default_implementation
from xmoe_jax.kernels.gmm import gmm, tgmm
from xmoe_jax.kernels.permute import combine, permute

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "combine",
    "default_implementation",
    "gmm",
    "permute",
    "tgmm",
]
