"""JAX's persistent compilation cache for `xmoe-train`: a second start of the same config (a resume,
a rerun, a requeued job) reads the compiled step from disk instead of compiling it again.

Where: `--compile-cache DIR`, else `$XMOE_COMPILE_CACHE`, else `$XDG_CACHE_HOME/xmoe_jax/jax`
(`~/.cache/xmoe_jax/jax`). `off` (flag or variable) turns it off. JAX keys each entry by the
program, the backend and its flags, and the JAX/jaxlib versions, so one folder serves every config
and machine kind; delete it to reclaim the space. Compiles shorter than `MIN_COMPILE_S` are not
written (they cost less than reading them). benchmarks/startup.md measures a second start.

`enable` says once what it did: the folder, or off and why. A folder it cannot create or write
(a read-only mount; JAX would warn twice per compiled program and write nothing) leaves the cache
off. JAX writes an entry in place, so a full disk or a kill mid-write leaves it truncated, and JAX
then warns and recompiles at every start. So `enable` checks the entries written since it last
looked (each decompresses whole; `VERIFIED` records the checked ones by size and time) and drops
the damaged ones, in one line.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

log = logging.getLogger("xmoe_jax")

ENV = "XMOE_COMPILE_CACHE"
OFF = "off"
MIN_COMPILE_S = 0.5
VERIFIED = "xmoe-verified.json"  # entry name -> [size, mtime_ns] of entries found intact
_ENTRY = "*-cache"  # JAX's file cache: `<key>-cache`
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xmoe_jax" / "jax"


def cache_dir(flag: str | None = None) -> Path | None:
    """The folder the flag, the environment or the default names; None when turned off."""
    value = (flag if flag is not None else os.environ.get(ENV, "")).strip()
    if value.lower() == OFF:
        return None
    return Path(value).expanduser() if value else default_dir()


def enable(flag: str | None = None) -> Path | None:
    """Turns JAX's persistent cache on in `cache_dir(flag)` (before the first compile) and returns
    the folder, or None (off). A folder that cannot be created or written leaves the cache off: a
    cache is never a reason not to train. Logs one line either way."""
    directory = cache_dir(flag)
    if directory is None:
        log.info("compilation cache: off (--compile-cache off or %s=off)", ENV)
        return None
    from xmoe_jax.train import writable

    try:
        directory.mkdir(parents=True, exist_ok=True)
        writable.probe_write(directory)
    except OSError as e:
        log.warning(
            "compilation cache off: %s cannot be written (%s); every start compiles. --compile-cache names "
            "another folder (or off)",
            directory,
            e.strerror or e,
        )
        return None
    drop_damaged(directory)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("compilation cache: %s", directory)
    return directory


def _intact(data: bytes) -> bool | None:
    """Whether a cache entry decompresses whole: None when it cannot be told (zstd not installed)."""
    if data.startswith(_ZSTD_MAGIC):
        try:
            from compression import zstd  # Python 3.14

            decompress = zstd.decompress
        except ImportError:
            try:
                import zstandard
            except ImportError:
                return None
            decompress = zstandard.ZstdDecompressor().decompress
        errors: tuple[type[Exception], ...] = (Exception,)  # each library has its own error class
    else:
        decompress, errors = zlib.decompress, (zlib.error,)
    try:
        decompress(data)
    except errors:
        return False
    return True


def drop_damaged(directory: Path) -> list[str]:
    """Removes the entries of `directory` that do not decompress whole (a write cut short), checking
    only those not in `VERIFIED`; says so in one line and returns their names."""
    record = directory / VERIFIED
    try:
        verified = json.loads(record.read_text())
        verified = verified if isinstance(verified, dict) else {}
    except (OSError, ValueError):
        verified = {}
    seen, dropped = {}, []
    for entry in sorted(directory.glob(_ENTRY)):
        try:
            st = entry.stat()
            stamp = [st.st_size, st.st_mtime_ns]
            if verified.get(entry.name) != stamp:
                if _intact(entry.read_bytes()) is False:
                    entry.unlink()
                    dropped.append(entry.name)
                    continue
            seen[entry.name] = stamp
        except OSError:  # removed meanwhile by another process, or unreadable: JAX's to judge
            continue
    if dropped:
        log.warning(
            "compilation cache: dropped %d damaged entr%s in %s (a write cut short by a full disk or a kill); "
            "those programs compile again",
            len(dropped),
            "y" if len(dropped) == 1 else "ies",
            directory,
        )
    if seen != verified:
        tmp = record.with_name(f".{VERIFIED}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(seen))
            os.replace(tmp, record)
        except OSError:
            tmp.unlink(missing_ok=True)
    return dropped
