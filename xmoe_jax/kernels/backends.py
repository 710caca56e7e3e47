"""Which backend runs a kernel: platform detection, per-platform defaults, and fallbacks.

Backends (`implementation=`):
  "xla"     jax.lax.ragged_dot / ragged_dot_general / gathers: the oracle, runs everywhere.
  "pallas"  Triton-style Pallas kernels: Triton lowering on CUDA and ROCm, interpret mode on CPU.
  "triton"  the same algorithm as a Triton kernel called through jax-triton (CUDA, ROCm).
  "mgpu"    JAX's bundled Mosaic-GPU ragged dots (Hopper, NVIDIA only).

`implementation=None` takes DEFAULT_IMPLEMENTATION[platform]. A backend that cannot run a
call (platform, missing package, shape constraint) falls back along FALLBACK, ending at
"xla", with one warning per distinct reason, so a call never fails for lack of a kernel.
The decision is made at trace time from static facts only: a jitted function never
compiles a kernel that cannot run.

Update DEFAULT_IMPLEMENTATION and DEFAULT_TILES from scripts/bench_gmm.py results.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import jax

IMPLEMENTATIONS = ("xla", "pallas", "triton", "mgpu")

# Fastest measured backend per platform and op (scripts/bench_gmm.py, one H100, jax 0.11.2,
# X-MoE Small and Large expert shapes, bf16): pallas reached 74-87% of a same-shape dense
# matmul in fwd/dgrad/wgrad; triton (jax-triton) was within 0-8% of it but is an extra package;
# mgpu (JAX's untuned Mosaic ragged dots) 36-45% in fwd/dgrad, 51-70% in wgrad; XLA 1-3%.
# Permute/combine: pallas 80-82% of device-copy bandwidth, XLA's permute 46%.
DEFAULT_IMPLEMENTATION = {
    "cpu": {"gmm": "xla", "tgmm": "xla", "permute": "xla"},
    "cuda": {"gmm": "pallas", "tgmm": "pallas", "permute": "pallas"},
    "rocm": {"gmm": "pallas", "tgmm": "pallas", "permute": "pallas"},
}

# (block_m, block_k, block_n) per (backend, platform) and op. For tgmm block_m is the chunk of
# rows reduced per step and (block_k, block_n) the output tile. Tests pass their own tiles.
# CUDA values: best of scripts/bench_gmm.py --sweep on one H100 (Small up-projection, bf16).
_CUDA_TILES = {"gmm": (128, 64, 256), "tgmm": (64, 128, 256)}
_CUDA_LAUNCH = {"gmm": (8, 4), "tgmm": (8, 3)}  # (num_warps, num_stages)
# ROCm: untuned guesses sized for 64 KiB of LDS; measure before trusting.
_ROCM_TILES = {"gmm": (128, 64, 128), "tgmm": (64, 64, 128)}
_ROCM_LAUNCH = {"gmm": (8, 2), "tgmm": (8, 2)}
DEFAULT_TILES = {
    ("pallas", "cpu"): {"gmm": (16, 16, 16), "tgmm": (16, 16, 16)},
    ("pallas", "cuda"): dict(_CUDA_TILES),
    ("triton", "cuda"): dict(_CUDA_TILES),
    ("mgpu", "cuda"): {"gmm": (128, 64, 128), "tgmm": (128, 64, 128)},
    ("pallas", "rocm"): dict(_ROCM_TILES),
    ("triton", "rocm"): dict(_ROCM_TILES),
}
# Triton launch parameters (num_warps, num_stages) per (backend, platform) and op.
LAUNCH = {
    ("pallas", "cuda"): dict(_CUDA_LAUNCH),
    ("triton", "cuda"): dict(_CUDA_LAUNCH),
    ("pallas", "rocm"): dict(_ROCM_LAUNCH),
    ("triton", "rocm"): dict(_ROCM_LAUNCH),
}
SHARED_MEMORY_BYTES = {"cuda": 227 * 1024, "rocm": 64 * 1024}

FALLBACK = {"mgpu": "pallas", "triton": "pallas", "pallas": "xla"}


@functools.cache
def platform() -> str:
    """'cpu', 'cuda', 'rocm', or another jax backend name (e.g. 'tpu')."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def default_implementation(op: str) -> str:
    return DEFAULT_IMPLEMENTATION.get(platform(), {}).get(op, "xla")


def default_tile(implementation: str, op: str = "gmm") -> tuple[int, int, int]:
    return DEFAULT_TILES.get((implementation, platform()), _CUDA_TILES)[op]


def launch_params(implementation: str, op: str, tile, itemsize: int) -> tuple[int | None, int | None]:
    """(num_warps, num_stages), with stages cut until the pipelined tiles fit in shared memory."""
    num_warps, num_stages = LAUNCH.get((implementation, platform()), {}).get(op, (None, None))
    limit = SHARED_MEMORY_BYTES.get(platform())
    if num_stages is None or limit is None:
        return num_warps, num_stages
    bm, bk, bn = tile
    per_stage = (bm * bk + (bk * bn if op == "gmm" else bm * bn)) * itemsize
    while num_stages > 1 and num_stages * per_stage > limit:
        num_stages -= 1
    return num_warps, num_stages


def interpret() -> bool:
    """Pallas kernels run in interpret mode off-GPU."""
    return platform() not in ("cuda", "rocm")


@functools.cache
def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def is_hopper() -> bool:
    if platform() != "cuda":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def check_name(implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")


def unavailable_reason(implementation: str) -> str | None:
    """Why a backend cannot run on this machine at all, or None if it can."""
    plat = platform()
    if implementation == "xla":
        return None
    if implementation == "pallas":
        return None if plat in ("cpu", "cuda", "rocm") else f"no Pallas Triton lowering on {plat}"
    if implementation == "triton":
        if plat not in ("cuda", "rocm"):
            return f"jax-triton needs a GPU, platform is {plat}"
        if not (has_module("jax_triton") and has_module("triton")):
            return "jax-triton is not installed (pip install 'xmoe_jax[triton]')"
        return None
    if implementation == "mgpu":
        if not is_hopper():
            return "Mosaic GPU ragged dot needs an NVIDIA Hopper GPU"
        if not has_module("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu"):
            return "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu is not in this jax"
        return None
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def reset_warnings() -> None:
    """Let every fallback warn again (scripts that report which backend actually ran)."""
    _warn_once.cache_clear()


def resolve(op: str, implementation: str | None, shape_reason=None) -> str:
    """The backend that will run `op`: the requested one, or the first fallback that can.

    `shape_reason(impl)` returns why a backend cannot take this call's shapes (or None).
    """
    check_name(implementation)
    impl = default_implementation(op) if implementation is None else implementation
    while True:
        reason = unavailable_reason(impl)
        if reason is None and shape_reason is not None:
            reason = shape_reason(impl)
        if reason is None:
            return impl
        nxt = FALLBACK[impl]
        _warn_once(f"{op}: implementation {impl!r} unavailable ({reason}); using {nxt!r}")
        impl = nxt
