"""Argument checks shared by every kernel entry point.

Errors are raised at trace time (shapes and dtypes are static) and name the argument
and what it should be, so a wrong call fails before anything compiles.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_rank(name: str, x, rank: int, shape_name: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} ({shape_name}), got shape {tuple(x.shape)}")


def check_float(name: str, x) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_int32(name: str, x) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32, got {x.dtype} (cast with .astype(jnp.int32))")


def check_dim(name: str, got: int, other: str, want: int) -> None:
    if got != want:
        raise ValueError(f"{name} is {got} but must equal {other} = {want}")


def check_tile(tile, *, power_of_two: bool) -> tuple[int, int, int]:
    """`tile` = (block_m, block_k, block_n): rows, contraction and output columns per program."""
    if tile is None:
        raise ValueError("tile must be a (block_m, block_k, block_n) tuple")
    tile = tuple(int(t) for t in tile)
    if len(tile) != 3 or any(t <= 0 for t in tile):
        raise ValueError(f"tile must be three positive ints (block_m, block_k, block_n), got {tile}")
    if power_of_two and any(t & (t - 1) for t in tile):
        raise ValueError(f"tile entries must be powers of 2 for Pallas/Triton kernels, got {tile}")
    if power_of_two and min(tile) < 16:
        raise ValueError(f"tile entries must be >= 16 (matrix-unit minimum), got {tile}")
    return tile


def out_dtype(lhs_dtype, preferred_element_type) -> np.dtype:
    dt = jnp.dtype(lhs_dtype if preferred_element_type is None else preferred_element_type)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"preferred_element_type must be bfloat16, float16 or float32, got {dt}")
    return dt


def check_gmm_args(lhs_RK, rhs_EKN, group_sizes_E, *, transpose_rhs: bool = False) -> None:
    check_rank("lhs", lhs_RK, 2, "[rows, K]")
    check_rank("rhs", rhs_EKN, 3, "[experts, N, K]" if transpose_rhs else "[experts, K, N]")
    check_rank("group_sizes", group_sizes_E, 1, "[experts]")
    check_float("lhs", lhs_RK)
    check_float("rhs", rhs_EKN)
    if lhs_RK.dtype != rhs_EKN.dtype:
        raise TypeError(
            f"lhs and rhs must share a dtype, got {lhs_RK.dtype} and {rhs_EKN.dtype} "
            "(cast the weights to the activation dtype first)"
        )
    check_int32("group_sizes", group_sizes_E)
    k_axis = 2 if transpose_rhs else 1
    check_dim(f"rhs.shape[{k_axis}] (K)", rhs_EKN.shape[k_axis], "lhs.shape[1]", lhs_RK.shape[1])
    check_dim("group_sizes.shape[0] (E)", group_sizes_E.shape[0], "rhs.shape[0]", rhs_EKN.shape[0])


def check_tgmm_args(lhs_RK, grad_RN, group_sizes_E, *, same_rows: bool = True) -> None:
    check_rank("lhs", lhs_RK, 2, "[rows, K]")
    check_rank("grad", grad_RN, 2, "[rows, N]")
    check_rank("group_sizes", group_sizes_E, 1, "[experts]")
    check_float("lhs", lhs_RK)
    check_float("grad", grad_RN)
    if lhs_RK.dtype != grad_RN.dtype:
        raise TypeError(f"lhs and grad must share a dtype, got {lhs_RK.dtype} and {grad_RN.dtype}")
    check_int32("group_sizes", group_sizes_E)
    if same_rows:
        check_dim("grad.shape[0] (rows)", grad_RN.shape[0], "lhs.shape[0]", lhs_RK.shape[0])


def check_row_index(name: str, rows_R, num_rows: int | None = None, other: str = "") -> None:
    """A row index: int32 [R]; with num_rows, R must equal it (`other` names what gives it)."""
    check_rank(name, rows_R, 1, "[rows]")
    check_int32(name, rows_R)
    if num_rows is not None:
        check_dim(f"{name}.shape[0] (rows)", rows_R.shape[0], other, num_rows)


def check_out_rows(out_rows_R, num_out_rows) -> None:
    """out_rows_R and num_out_rows come together; num_out_rows is a positive static int."""
    if (out_rows_R is None) != (num_out_rows is None):
        raise ValueError(
            "out_rows_R and num_out_rows must be given together (the output has num_out_rows rows)"
        )
    if num_out_rows is not None and (not isinstance(num_out_rows, int | np.integer) or num_out_rows <= 0):
        raise ValueError(f"num_out_rows must be a positive int, got {num_out_rows!r}")
