"""FP8 recipes: which tiles share a scale, and which 8-bit format each GEMM operand takes.

Legend: M rows (tokens or routed rows), K contraction, N output columns, E experts.

| recipe     | activations / grads x_MK | weights w_EKN           | after                          |
|------------|--------------------------|-------------------------|--------------------------------|
| tensorwise | one scale per tensor     | one scale per tensor    | Transformer Engine's delayed-free current scaling |
| rowwise    | one per row (over K)     | one per column (over K) | torchao's rowwise float8       |
| blockwise  | 1x128 tiles along K      | 128x128 blocks          | DeepSeek-V3                    |

Scaling is current (just-in-time): each GEMM computes its operands' scales from their amax
when it runs; no amax history is kept. Activations and weights are e4m3. Output gradients are
`grad_format`: e4m3 by default (DeepSeek-V3 keeps e4m3 for all tensors; fine-grained scales give
the range), e5m2 on request (the classic hybrid split, more range, less precision).

Accumulation: Hopper's FP8 tensor cores keep fewer than float32's bits in their accumulator. By
default the kernel adds each 128-long K slice's partial sum into a float32 register accumulator
(DeepSeek-V3's promotion); `fast_accum` leaves the whole K loop to the tensor core, as torch's
`use_fast_accum=True` does (faster; benchmarks/fp8.md measures both, speed and error).

Which GEMMs run in FP8: the forward product and the input gradient (dgrad = grad @ w.T); the
weight gradient (wgrad = x.T @ grad) stays bf16 with float32 accumulation. Its contraction
runs over rows, which per-row or 1x128 scales do not factor out of, and the 128x1 tiles it
needs would have to follow the experts' group boundaries; that is not built yet.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xmoe_jax.fp8.formats import fp8_dtype

RECIPES = ("tensorwise", "rowwise", "blockwise")
BLOCK = 128  # DeepSeek-V3's tile: 1x128 activations, 128x128 weights


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One FP8 recipe; hashable, so it can be a static argument of jitted and custom_vjp functions."""

    name: str = "rowwise"
    grad_format: str = "e4m3"
    fast_accum: bool = False  # Hopper FP8 tensor cores' own accumulation along all of K (see below)
    platform: str | None = None  # None: this machine's (formats.py picks OCP or fnuz)

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {self.name!r}")
        if self.grad_format not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8 grad_format must be 'e4m3' or 'e5m2', got {self.grad_format!r}")

    @property
    def act_dtype(self) -> np.dtype:
        return fp8_dtype("e4m3", self.platform)

    @property
    def grad_dtype(self) -> np.dtype:
        return fp8_dtype(self.grad_format, self.platform)

    @property
    def imprecise_acc(self) -> int:
        """K elements the FP8 kernel sums inside the tensor core before a float32 add
        (kernels/gmm/fp8_dot.py): 128 as DeepSeek-V3 promotes, or all of K with fast_accum."""
        return 1 << 30 if self.fast_accum else BLOCK

    @property
    def block_k(self) -> int:
        """Length of a K-block that shares one scale (0: scales do not vary along K)."""
        return BLOCK if self.name == "blockwise" else 0

    def lhs_block(self) -> tuple:
        """Tile of an [M, K] operand (activations, output gradients)."""
        return {"tensorwise": (None, None), "rowwise": (1, None), "blockwise": (1, BLOCK)}[self.name]

    def rhs_block(self) -> tuple:
        """Tile of an [E, K, N] weight stack (E = 1 for a dense weight)."""
        return {"tensorwise": (None, None, None), "rowwise": (1, None, 1), "blockwise": (1, BLOCK, BLOCK)}[
            self.name
        ]
