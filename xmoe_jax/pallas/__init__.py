"""Kernels (grouped GEMM, permute/combine) beside their XLA references.

Populated by the kernels work; every op here keeps an XLA fallback.
"""
