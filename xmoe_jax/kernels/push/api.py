"""`push_rows`: rows written straight into peers' receive buffers (the `push` transport's kernel).

Legend: N send rows, M receive rows, D row width, P peers on the exchange axis, X = P * U updates.

    out_MD = push_rows(x_ND, meta_3X, out_rows=M, axis_name="expert", num_peers=P, max_piece=C)

`meta_3X` (int32) holds per update x its source row offset, row count and destination row offset;
update x goes to peer x // U, so U updates per peer can land one peer's rows in several places
(per local expert: expert-major arrival). Inside a `shard_map` over `axis_name`.

Implementations: "mgpu" (mgpu.py: Pallas Mosaic GPU, NVIDIA Hopper, one process for all GPUs of
the axis) and "xla" (xla.py: padded all_to_all, any platform: the oracle, and what CPU runs).
None picks mgpu on a Hopper GPU and xla on CPU; elsewhere (ROCm, pre-Hopper NVIDIA) there is no
push kernel and the call is refused, naming the `bucketed` transport (resolve.py refuses such a
run at start-up already). Not differentiable by itself: moe/exchange.py's custom VJP runs the
reverse plan through it.

    out_MD = gmm_push(lhs_RK, rhs_EKN, group_sizes_E, meta_3X, out_rows=M, axis_name=..., num_peers=P, max_piece=C)

is `push_rows(gmm(lhs_RK, rhs_EKN, group_sizes_E), meta_3X, ...)` where the rows are grouped by local
expert and update x = p * U + g moves (part of) group g: the return exchange of expert-major arrival.
"mgpu" runs it as one kernel, the warp-specialized grouped GEMM whose epilogue stores each output
tile's rows straight into the peers' buffers (gmm/mgpu_ws.py, `PushSpec`), so the exchange runs
under the GEMM; shapes that kernel refuses, and a gmm default other than ws (XMOE_KERNELS=pallas),
run the GEMM and then the push kernel. "xla": the grouped
GEMM (kernels.gmm's default) and then the push reference.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from xmoe_jax.kernels.platform import is_hopper, platform
from xmoe_jax.kernels.push import mgpu, xla

IMPLEMENTATIONS = ("mgpu", "xla")


def unavailable_reason() -> str | None:
    """Why the Mosaic push kernel cannot run on the platform kernels are chosen for, or None."""
    if platform() == "cpu":
        return None  # the reference stands in
    if platform() != "cuda":
        return f"the push kernel is Mosaic GPU (NVIDIA only); platform is {platform()}"
    if not is_hopper():
        return "the push kernel needs an NVIDIA Hopper (sm90) GPU or later"
    return None


def _implementation(implementation: str | None) -> str:
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    impl = implementation or ("xla" if platform() == "cpu" else "mgpu")
    if impl == "mgpu":
        reason = unavailable_reason() or ("no GPU to run Mosaic GPU on" if platform() == "cpu" else None)
        if reason:
            raise ValueError(f"parallel.transport=push: {reason}; use parallel.transport=bucketed")
    return impl


def push_rows(
    x_ND: jax.Array,
    meta_3X: jax.Array,
    *,
    out_rows: int,
    axis_name: str,
    num_peers: int,
    max_piece: int,
    implementation: str | None = None,
    **tuning,
) -> jax.Array:
    """[out_rows, D] on each device: the rows its peers' updates sent it (module docstring).

    `max_piece` bounds any update's rows (the reference pads to it). `tuning`: mgpu's num_ctas,
    stages, block_bytes. Rows no update targets: zeros (xla), undefined (mgpu)."""
    if _implementation(implementation) == "mgpu":
        return mgpu.push_rows(
            x_ND, meta_3X, out_rows=out_rows, axis_name=axis_name, num_peers=num_peers, **tuning
        )
    return xla.push_rows_reference(x_ND, meta_3X, out_rows=out_rows, axis_name=axis_name, max_piece=max_piece)


def _ws_plan(op: str, rhs_EKN, meta_3X, num_peers: int, transpose_rhs: bool):
    """(U, the ws config) of a GEMM fused with an exchange of U = E updates per peer."""
    from xmoe_jax.kernels import defaults

    num_groups, n_dim = rhs_EKN.shape[0], rhs_EKN.shape[1 if transpose_rhs else 2]
    if meta_3X.shape[1] != num_peers * num_groups:
        raise ValueError(
            f"{op}: meta_3X has {meta_3X.shape[1]} updates, not {num_peers} peers x {num_groups} groups"
        )
    return num_groups, defaults.ws_config(n_dim)


def _fused(impl: str, lhs, rhs_EKN, config, num_rows: int, transpose_rhs: bool) -> bool:
    """One kernel where the contiguous gmm runs on ws and takes these shapes (XMOE_KERNELS=pallas, or
    shapes ws refuses: the GEMM and the push kernel one after the other)."""
    from xmoe_jax.kernels import defaults
    from xmoe_jax.kernels.gmm import mgpu_ws

    if impl != "mgpu" or defaults.default_implementation("gmm") != "ws" or lhs.dtype != rhs_EKN.dtype:
        return False
    n_dim = rhs_EKN.shape[1 if transpose_rhs else 2]
    return not mgpu_ws.shape_reason(lhs.dtype, lhs.shape[1], n_dim, config, num_rows)


def gmm_push(
    lhs_RK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    meta_3X: jax.Array,
    *,
    out_rows: int,
    axis_name: str,
    num_peers: int,
    max_piece: int,
    transpose_rhs: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """[out_rows, N] on each device: `push_rows(gmm(lhs_RK, rhs_EKN, group_sizes_E), meta_3X, ...)`
    (module docstring), lhs's rows grouped by local expert (U = E groups per peer); rhs [E, N, K]
    with `transpose_rhs`. Rows no update targets: zeros (xla), undefined (mgpu)."""
    from xmoe_jax.kernels import gmm
    from xmoe_jax.kernels.gmm import mgpu_ws

    impl = _implementation(implementation)
    num_groups, config = _ws_plan("gmm_push", rhs_EKN, meta_3X, num_peers, transpose_rhs)
    fused = _fused(impl, lhs_RK, rhs_EKN, config, lhs_RK.shape[0], transpose_rhs) and out_rows % 8 == 0
    if fused:
        spec = mgpu_ws.PushSpec(axis_name, num_peers, num_groups, out_rows)
        out_MD = mgpu_ws.gmm_ws(
            lhs_RK,
            rhs_EKN,
            group_sizes_E,
            config=config,
            transpose_rhs=transpose_rhs,
            push=spec,
            seg_3X=meta_3X,
        )
        return jax.lax.optimization_barrier(out_MD)  # as push_rows' result (mgpu.py says why)
    y_RN = gmm(lhs_RK, rhs_EKN, group_sizes_E.astype(jnp.int32), transpose_rhs=transpose_rhs)
    return push_rows(
        y_RN, meta_3X, out_rows=out_rows, axis_name=axis_name, num_peers=num_peers, max_piece=max_piece,
        implementation=impl,
    )  # fmt: skip


ARRIVE_CTAS_ENV = "XMOE_ARRIVE_CTAS"  # CTAs that push in push_gmm's kernel (the rest run the GEMM)


def arrive_ctas() -> int:
    """CTAs that copy in push_gmm's kernel: XMOE_ARRIVE_CTAS (for tuning: scripts/bench_gmm_push.py
    --arrive-ctas), else 16 (not yet tuned on a GPU)."""
    value = os.environ.get(ARRIVE_CTAS_ENV, "16")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ARRIVE_CTAS_ENV}={value!r}: use a positive number of CTAs (16 by default)")
    return int(value)


def push_gmm(
    x_ND: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    meta_3X: jax.Array,
    *,
    out_rows: int,
    axis_name: str,
    num_peers: int,
    max_piece: int,
    transpose_rhs: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(recv_MD, out_MN) on each device: `push_rows(x_ND, meta_3X, ...)` and the grouped GEMM of what
    arrived (module docstring), U = E groups per peer; rhs [E, N, K] with `transpose_rhs`. Rows no
    update targets: zeros (xla), undefined (mgpu); out's rows past sum(group_sizes) are unspecified."""
    from xmoe_jax.kernels import gmm
    from xmoe_jax.kernels.gmm import mgpu_ws

    impl = _implementation(implementation)
    num_groups, config = _ws_plan("push_gmm", rhs_EKN, meta_3X, num_peers, transpose_rhs)
    if _fused(impl, x_ND, rhs_EKN, config, out_rows, transpose_rhs):
        spec = mgpu_ws.ArriveSpec(axis_name, num_peers, num_groups, out_rows, push_ctas=arrive_ctas())
        recv_MD, out_MN = mgpu_ws.arrive_gmm_ws(
            x_ND, meta_3X, rhs_EKN, group_sizes_E, arrive=spec, config=config, transpose_rhs=transpose_rhs
        )
        return jax.lax.optimization_barrier((recv_MD, out_MN))  # as push_rows' result (mgpu.py says why)
    recv_MD = push_rows(
        x_ND, meta_3X, out_rows=out_rows, axis_name=axis_name, num_peers=num_peers, max_piece=max_piece,
        implementation=impl,
    )  # fmt: skip
    out_MN = gmm(
        recv_MD, rhs_EKN, group_sizes_E.astype(jnp.int32), transpose_rhs=transpose_rhs, zero_unwritten=False
    )
    return recv_MD, out_MN
