"""XLA flag defaults the library relies on, applied before the backend starts.

XLA reads XLA_FLAGS once, when the first backend initialises, so
`apply_defaults()` must run before any JAX computation (the CLI and the scripts
call it first). A flag the user already set in XLA_FLAGS is never overridden.

GPU presets for the ragged all-to-all (measured on 2x H200, jax 0.11.2, 49k rows of
2048 bf16 per peer pair; benchmarks/pft.md):
  default     XLA's own ragged all-to-all kernel: 2.7 GB/s (1.8% of a dense all_to_all);
  decomposer  lowers it to a dense all-to-all: 82 GB/s, but padding is back on the wire
              (so `wire_bytes` under-reports what actually moves);
  sendrecv    the exact-bytes NCCL send/recv path: hung in our runs (no result in 75 s).
The library default is `decomposer`, the fastest measured; set XMOE_RAGGED_A2A (or
XLA_FLAGS yourself) to choose another.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("xmoe_jax")

RAGGED_A2A_PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    "decomposer": {"xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": "true"},
    "sendrecv": {
        "xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel": "false",
        "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": "true",
    },
}
DEFAULT_RAGGED_A2A_PRESET = "decomposer"


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # private API moved: assume not started
        return False


def apply_defaults(preset: str | None = None, extra: dict[str, str] | None = None) -> str:
    """Adds the preset's flags (and `extra`) to XLA_FLAGS unless already set; returns XLA_FLAGS."""
    preset = preset or os.environ.get("XMOE_RAGGED_A2A", DEFAULT_RAGGED_A2A_PRESET)
    if preset not in RAGGED_A2A_PRESETS:
        raise ValueError(f"XMOE_RAGGED_A2A={preset!r} is not one of {sorted(RAGGED_A2A_PRESETS)}")
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = {**RAGGED_A2A_PRESETS[preset], **(extra or {})}
    added = [f"--{k}={v}" for k, v in wanted.items() if f"--{k}" not in flags]
    if added and _backend_started():
        log.warning("XLA backend already started; flags %s will not take effect", added)
    os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return os.environ["XLA_FLAGS"]
