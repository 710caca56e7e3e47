"""Units people type and read: byte sizes on the command line, counts in tables and logs.

`parse_bytes` is the one parser of size flags (`xmoe-plan --device-memory`, `xmoe-convert
--max-shard-size`). Units are case-insensitive: B; K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB.
KB, MB, GB and TB are decimal (1000^n, as HuggingFace's shard sizes and GPU data sheets count);
KiB, MiB, GiB and TiB are binary (1024^n), and so are the bare letters K, M, G and T, as in
SLURM's `--mem=64G`, `ls -h` and `numfmt --from=iec`.
"""

from __future__ import annotations

import math
import re

from xmoe_jax.config import ConfigError

_PREFIXES = "kmgt"
ACCEPTED = "B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (case-insensitive; KB = 1000 bytes, K = KiB = 1024)"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


def _scale(unit: str) -> int | None:
    """Bytes per `unit` (lower case), or None if it is not one."""
    if unit in ("", "b"):
        return 1
    power = _PREFIXES.find(unit[:1]) + 1
    if power == 0:
        return None
    rest = unit[1:]
    if rest in ("", "ib", "i"):
        return 1024**power
    if rest == "b":
        return 1000**power
    return None


def parse_bytes(text: str, flag: str = "size") -> int:
    """'64GiB', '80GB', '64G', '500kb', '141e9' -> bytes; a ConfigError naming `flag` and the units
    it accepts otherwise (not a size, a unit it does not know, or not above zero)."""
    match = _SIZE.match(str(text).lower())
    scale = _scale(match.group(2)) if match else None
    if scale is None:
        raise ConfigError(
            f"{flag}={text!r} is not a size: give a number and a unit, e.g. 64GiB; units: {ACCEPTED}"
        )
    size = float(match.group(1)) * scale
    if not math.isfinite(size) or size < 1:
        raise ConfigError(f"{flag}={text!r} must be at least 1 byte, e.g. 500MB; units: {ACCEPTED}")
    return int(size)


def format_count(n: float, digits: int = 2) -> str:
    """A count in the unit that fits it: 340_224 -> '340.22K', 2.7e6 -> '2.70M', 1.6e10 -> '16.00B'
    (K thousand, M million, B billion, T trillion); below a thousand, the number itself."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.{digits}f}"
