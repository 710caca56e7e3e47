"""JAX's persistent compilation cache for `xmoe-train`: a second start of the same config (a resume,
a rerun, a requeued job) reads the compiled step from disk instead of compiling it again.

Where: `--compile-cache DIR`, else `$XMOE_COMPILE_CACHE`, else `$XDG_CACHE_HOME/xmoe_jax/jax`
(`~/.cache/xmoe_jax/jax`). `off` (flag or variable) turns it off. JAX keys each entry by the
program, the backend and its flags, and the JAX/jaxlib versions, so one folder serves every config
and machine kind; delete it to reclaim the space. Compiles shorter than `MIN_COMPILE_S` are not
written (they cost less than reading them). benchmarks/startup.md measures a second start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "XMOE_COMPILE_CACHE"
OFF = "off"
MIN_COMPILE_S = 0.5


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
    the folder, or None (off). A folder that cannot be created leaves the cache off: a cache is
    never a reason not to train."""
    directory = cache_dir(flag)
    if directory is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning(
            "compilation cache off: cannot create %s (%s); --compile-cache names another", directory, e
        )
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
