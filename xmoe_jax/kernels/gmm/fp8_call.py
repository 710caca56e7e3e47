"""One FP8 grouped GEMM on quantized operands, as every backend takes it: the signature, written once.

Legend: L lhs rows, R grouped rows, O output rows, K contraction, N output columns, E experts,
B K-blocks of the scales (cdiv(K, block_k) for blockwise scales, else 1; fp8/operands.py).

fp8/gmm.py builds an `Fp8Gmm`; backends.py's `gmm_fp8(call, tile=...)` hands it to the oracle
(gmm/xla.py) or the kernel (gmm/pallas_fp8.py). Rows follow gmm/api.py: optional gather and
scatter indices, rows past sum(group_sizes) neither read, computed nor stored, unwritten output
rows zeros only with `zero_unwritten`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class Fp8Gmm(NamedTuple):
    lhs_q_LK: jax.Array  # fp8 [L, K]
    lhs_s_LB: jax.Array  # float32 [L, B] row scales per K-block
    rhs_q_EKN: jax.Array  # fp8 [E, K, N]
    rhs_s_EBN: jax.Array  # float32 [E, B, N] column scales per K-block
    group_sizes_E: jax.Array  # int32 [E]
    out_dtype: Any
    block_k: int = 0  # the scales' K-block (0: one scale along K)
    imprecise_acc: int = 128  # K elements summed in the tensor core per float32 add (fp8_dot.py)
    lhs_rows_R: jax.Array | None = None  # gather index (gmm/api.py)
    out_rows_R: jax.Array | None = None  # scatter index
    num_out_rows: int | None = None  # O, with out_rows_R
    zero_unwritten: bool = False  # zeros in the output rows nobody writes

    @property
    def rows(self) -> dict:
        """The row arguments as gmm's backends take them."""
        return dict(
            lhs_rows_R=self.lhs_rows_R, out_rows_R=self.out_rows_R, num_out_rows=self.num_out_rows,
            zero_unwritten=self.zero_unwritten,
        )  # fmt: skip

    @property
    def num_rows(self) -> int:
        """R, the grouped rows."""
        return self.lhs_q_LK.shape[0] if self.lhs_rows_R is None else self.lhs_rows_R.shape[0]

    @property
    def out_shape(self) -> jax.ShapeDtypeStruct:
        num_out = self.num_rows if self.out_rows_R is None else self.num_out_rows
        return jax.ShapeDtypeStruct((num_out, self.rhs_q_EKN.shape[2]), self.out_dtype)
