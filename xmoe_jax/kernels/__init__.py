"""Kernels for the MoE hot path, each beside its XLA reference (the oracle and the fallback).

    from xmoe_jax.kernels import gmm, tgmm, permute, combine

    x_sorted_RD = permute(x_TD, dest_A, num_rows)                 # tokens -> expert order
    h_RF        = gmm(x_sorted_RD, w_up_EDF, group_sizes_E)       # grouped GEMM
    h_RF        = gmm(x_TD, w_up_EDF, group_sizes_E,              # the same, rows gathered on load
                      lhs_rows_R=token_rows(dest_A, T, R))
    y_TD        = combine(y_sorted_RD, dest_A, weights_TK)        # expert order -> tokens

Backends (`implementation=`): "xla", "pallas" (Triton-style Pallas: Triton lowering on CUDA
and ROCm, interpret mode on CPU), "triton" (jax-triton, GPU only), "mgpu" (Mosaic GPU,
Hopper only); None picks the fastest measured one for the platform (defaults.py). All are
differentiable through custom VJPs and fall back to XLA when they cannot run.

Files, one folder per op:
  gmm/       api.py (public gmm / tgmm with optional row indices, custom VJPs), xla.py (oracle),
             pallas.py, pallas_fp8.py, triton.py, mgpu.py (one file per backend's kernels),
             schedule.py (the Triton-style kernels' tile schedule, written once),
             fused.py + activation.py (the expert activation inside the GEMMs around it:
             prologue / epilogue kernels and their XLA reference; not used by the MoE layer),
             metadata.py (row tile -> group work list)
  permute/   api.py (public permute / combine, custom VJPs), xla.py (oracle), pallas.py
  backends.py   IMPLEMENTATIONS, the registry of backend objects, and choose_backend (fallbacks)
  defaults.py   per-platform default backend, tiles and launch parameters (measured data)
  platform.py   platform detection (cpu / cuda / rocm, Hopper, installed packages), and `target`:
                choose for another platform (export for ROCm from a CPU host)
  validation.py argument checks;  vma.py  shard_map varying-axes alignment for the custom VJPs
"""

from xmoe_jax.kernels.backends import IMPLEMENTATIONS
from xmoe_jax.kernels.defaults import DEFAULT_IMPLEMENTATION, default_implementation
from xmoe_jax.kernels.gmm import gmm, shared_rows, tgmm
from xmoe_jax.kernels.permute import combine, permute, token_rows

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "combine",
    "default_implementation",
    "gmm",
    "permute",
    "shared_rows",
    "tgmm",
    "token_rows",
]
