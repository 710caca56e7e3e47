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
"""

from __future__ import annotations

import jax

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
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    impl = implementation or ("xla" if platform() == "cpu" else "mgpu")
    if impl == "mgpu":
        reason = unavailable_reason() or ("no GPU to run Mosaic GPU on" if platform() == "cpu" else None)
        if reason:
            raise ValueError(f"parallel.transport=push: {reason}; use parallel.transport=bucketed")
        return mgpu.push_rows(
            x_ND, meta_3X, out_rows=out_rows, axis_name=axis_name, num_peers=num_peers, **tuning
        )
    return xla.push_rows_reference(x_ND, meta_3X, out_rows=out_rows, axis_name=axis_name, max_piece=max_piece)
