"""FP8 formats per platform: which 8-bit float a recipe's "e4m3" / "e5m2" means on this machine.

NVIDIA Hopper takes the OCP formats float8_e4m3fn (max 448, no inf) and float8_e5m2 (max 57344).
AMD MI300 (gfx94x) takes the "fnuz" variants (float8_e4m3fnuz, max 240; float8_e5m2fnuz), whose
exponent bias is one larger and which have no negative zero. `fp8_dtype(kind, platform=...)`
picks by the platform helper; tests pass the platform to check both on CPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xmoe_jax.kernels.platform import platform as _platform

KINDS = ("e4m3", "e5m2")
_OCP = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_FNUZ = {"e4m3": jnp.float8_e4m3fnuz, "e5m2": jnp.float8_e5m2fnuz}


def wants_fnuz(platform: str) -> bool:
    """MI300-class ROCm GPUs use the fnuz formats; NVIDIA and CPU use the OCP ones."""
    return platform == "rocm"


def fp8_dtype(kind: str, platform: str | None = None) -> np.dtype:
    """The 8-bit float for `kind` ("e4m3" or "e5m2") on `platform` (None: this machine's)."""
    if kind not in KINDS:
        raise ValueError(f"fp8 format must be one of {KINDS}, got {kind!r}")
    plat = _platform() if platform is None else platform
    return jnp.dtype((_FNUZ if wants_fnuz(plat) else _OCP)[kind])


def max_value(dtype) -> float:
    """Largest finite value of an fp8 dtype: values are clipped to it before the cast (saturation)."""
    return float(jnp.finfo(dtype).max)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
