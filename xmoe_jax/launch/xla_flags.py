"""XLA flag defaults the library relies on, applied before the backend starts, and what took effect.

XLA reads XLA_FLAGS once, when the first backend initialises, so
`apply_defaults()` must run before any JAX computation (the CLI and the scripts
call it first). A flag the user already set in XLA_FLAGS is never overridden.
Called after the backend started, it warns once per flag, naming the flag and the
fix (flags for a GPU while the process runs on CPU only are skipped quietly).

GPU presets for the ragged all-to-all (measured on 2x H200, jax 0.11.2, 49k rows of
2048 bf16 per peer pair; benchmarks/pft.md):
  default     XLA's own ragged all-to-all kernel: 2.7 GB/s (1.8% of a dense all_to_all);
  decomposer  lowers it to a dense all-to-all: 82 GB/s, but padding is back on the wire
              (so `wire_bytes` under-reports what actually moves);
  sendrecv    the exact-bytes NCCL send/recv path: hung in our runs (no result in 75 s).
The library default is `decomposer`, the fastest measured; set XMOE_RAGGED_A2A (or
XLA_FLAGS yourself) to choose another.

GPU scheduler presets (`parallel.xla_scheduler`, or XMOE_XLA_SCHEDULER for scripts), opt-in:
  default         XLA's own scheduler. Collectives are async by default
                  (`--xla_gpu_disable_async_collectives` is empty), but with nothing scheduled
                  between an all-to-all's start and done XLA turns it back into a synchronous one,
                  so it never runs under a GEMM (benchmarks/exchange.md: 2 overlap chunks changed
                  nothing);
  latency_hiding  `--xla_gpu_enable_latency_hiding_scheduler=true` (default false in XLA;
                  "[Stable]" in debug_options_flags.cc): independent compute is moved between the
                  start and the done of each async collective. The older per-collective switches
                  (`--xla_gpu_enable_async_all_to_all` and kin) are gone from recent XLA, which
                  aborts on unknown flags (jax 0.10.2 does on that one), so they are not set.
The CLI reads the config before JAX starts and passes `parallel.xla_scheduler` here.

The transport check (`transport_for`, called once at start-up by xmoe_jax/resolve.py with the
settled transport) reads the flags the running backend started with (`effective_flags`), never
what XLA_FLAGS says now, against the facts of the transport's record (moe/transports.py): if the
wanted preset or a flag the record needs did not take effect, the transport stays, with one warning.
"""

from __future__ import annotations

import logging
import os
import re

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
# preset flags newer than the oldest jaxlib we run on: XLA aborts at start-up on a flag it does not
# know ("Unknown flag in XLA_FLAGS"), so a preset needing one is refused first, naming the fix
FLAG_SINCE: dict[str, tuple[int, int]] = {
    "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": (0, 11),  # absent from jaxlib 0.10.2
}
SCHEDULER_PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    "latency_hiding": {"xla_gpu_enable_latency_hiding_scheduler": "true"},
}
GPU_BACKENDS = ("gpu", "cuda", "rocm")
_FIX = (
    "call xmoe_jax.launch.xla_flags.apply_defaults() before anything starts JAX's backend (before "
    "jax.devices(), arrays or jit), or export XLA_FLAGS='{flags}' before starting Python"
)

_flags_at_start: str | None = None  # XLA_FLAGS as the running backend read them (when known)
_warned: set[str] = set()


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API moved: assume not started
        return False


def _parse(flags: str) -> dict[str, str]:
    """`--name=value` / `--name` words -> {name: lower-case value}."""
    out = {}
    for word in flags.split():
        name, sep, value = word.lstrip("-").partition("=")
        out[name] = value.lower() if sep else "true"
    return out


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def wanted_preset(preset: str | None = None, transport: str | None = None) -> str:
    """The ragged all-to-all preset asked for (argument, else XMOE_RAGGED_A2A, else the one
    `transport` asks for in the table of transports (moe/transports.ragged_preset): XLA's own one-shot
    kernel for `exact`, which feeds it many updates per peer and would be padded by the decomposer,
    and for `auto`; the decomposer otherwise)."""
    fallback = (
        _transport_facts().ragged_preset(transport) if transport else None
    ) or DEFAULT_RAGGED_A2A_PRESET
    preset = preset or os.environ.get("XMOE_RAGGED_A2A", fallback)
    if preset not in RAGGED_A2A_PRESETS:
        raise ValueError(f"XMOE_RAGGED_A2A={preset!r} is not one of {sorted(RAGGED_A2A_PRESETS)}")
    too_new = unknown_flags(RAGGED_A2A_PRESETS[preset])
    if too_new:
        import jaxlib

        raise ValueError(
            f"XMOE_RAGGED_A2A={preset} needs XLA flag(s) {', '.join('--' + f for f in too_new)}, which the XLA "
            f"in jaxlib {jaxlib.__version__} does not know (it would abort at start-up); install "
            f"jax>={'.'.join(map(str, max(FLAG_SINCE[f] for f in too_new)))} or choose another preset "
            f"({', '.join(p for p in RAGGED_A2A_PRESETS if p != preset)})"
        )
    return preset


def unknown_flags(flags: dict[str, str], version: str | None = None) -> list[str]:
    """The names in `flags` that the XLA in jaxlib `version` (default: the installed one) does not
    know, from `FLAG_SINCE`."""
    if version is None:
        import jaxlib

        version = jaxlib.__version__
    have = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    return [name for name in flags if name in FLAG_SINCE and have < FLAG_SINCE[name]]


def _transport_facts():
    """The table of transports (moe/transports.py), imported when asked: it loads JAX's modules
    but starts no backend, so the flags can still be added after it."""
    from xmoe_jax.moe import transports

    return transports


def wanted_scheduler(scheduler: str | None = None) -> str:
    """The scheduler preset asked for (argument, else XMOE_XLA_SCHEDULER, else `default`)."""
    scheduler = scheduler or os.environ.get("XMOE_XLA_SCHEDULER", "default")
    if scheduler not in SCHEDULER_PRESETS:
        raise ValueError(
            f"XMOE_XLA_SCHEDULER / parallel.xla_scheduler={scheduler!r} is not one of {sorted(SCHEDULER_PRESETS)}"
        )
    return scheduler


def effective_scheduler(flags: str | None = None) -> str:
    """`latency_hiding` if its flags are set so in `flags` (default: `effective_flags()`), else `default`."""
    parsed = _parse(effective_flags() if flags is None else flags)
    wanted = SCHEDULER_PRESETS["latency_hiding"]
    return "latency_hiding" if all(parsed.get(k) == v for k, v in wanted.items()) else "default"


def effective_flags() -> str:
    """XLA_FLAGS as the running backend read them; before it starts, what it will read.

    Best effort: the value is taken when xmoe_jax first sees the backend started (in
    `apply_defaults` or here), so flags that `apply_defaults` adds later are excluded, but an
    edit of XLA_FLAGS by hand between the start and that first look is not seen.
    """
    global _flags_at_start
    if not _backend_started():
        return os.environ.get("XLA_FLAGS", "")
    if _flags_at_start is None:
        _flags_at_start = os.environ.get("XLA_FLAGS", "")
    return _flags_at_start


def effective_preset(flags: str | None = None) -> str:
    """The ragged all-to-all preset in effect: `sendrecv` or `decomposer` if all its flags are
    set so in `flags` (default: `effective_flags()`), else `default` (XLA's own kernel)."""
    parsed = _parse(effective_flags() if flags is None else flags)
    for name in ("sendrecv", "decomposer"):
        if all(parsed.get(k) == v for k, v in RAGGED_A2A_PRESETS[name].items()):
            return name
    return "default"


def apply_defaults(
    preset: str | None = None,
    extra: dict[str, str] | None = None,
    scheduler: str | None = None,
    transport: str | None = None,
) -> str:
    """Adds the ragged all-to-all preset's flags (`wanted_preset(preset, transport)`), the scheduler
    preset's (`wanted_scheduler`), the flags the transport's record needs and `extra` to XLA_FLAGS, each unless XLA_FLAGS already sets it
    (the user wins); returns XLA_FLAGS. `transport`: `parallel.transport` (XMOE_TRANSPORT for scripts)."""
    transport = transport or os.environ.get("XMOE_TRANSPORT")
    preset = wanted_preset(preset, transport)
    scheduler = wanted_scheduler(scheduler)
    started = _backend_started()
    if started:
        effective_flags()  # remember what the backend read before adding anything
    flags = os.environ.get("XLA_FLAGS", "")
    needs = _transport_facts().xla_flags(transport) if transport else {}  # the record's own flags
    wanted = {**RAGGED_A2A_PRESETS[preset], **SCHEDULER_PRESETS[scheduler], **needs, **(extra or {})}
    added = [f"--{k}={v}" for k, v in wanted.items() if k not in _parse(flags)]
    if added and started:
        _warn_late(added)
    os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return os.environ["XLA_FLAGS"]


def _warn_late(added: list[str]) -> None:
    import jax

    on_cpu = jax.default_backend() not in GPU_BACKENDS
    for flag in added:
        if on_cpu and flag.startswith("--xla_gpu_"):
            log.debug("XLA flag %s added after the CPU backend started; it only matters on GPU", flag)
            continue
        _warn_once(
            flag,
            f"XLA flag {flag} does not take effect in this process: JAX's backend had already started "
            f"when xmoe_jax added it; {_FIX.format(flags=flag)}",
        )


def transport_for(requested: str, backend: str, flags: str | None = None) -> str:
    """Checks the XLA flags that concrete transport `requested` needs on `backend` against those the
    backend started with (`flags`, default: `effective_flags()`); returns `requested`.

    `auto` is settled before this (xmoe_jax/resolve.py). Off GPU nothing is checked. On GPU, from
    the record (moe/transports.py): a transport that insists on XLA's own ragged kernel (`exact`)
    running under another preset, a wanted preset (`wanted_preset()`, for `ragged`) whose flags did
    not take effect, or a flag of the record's own that did not, is named in one warning.
    """
    record = _transport_facts().get(requested)
    if backend not in GPU_BACKENDS:
        return requested
    parsed = _parse(effective_flags() if flags is None else flags)
    missing = [f"--{k}={v}" for k, v in record.xla_flags if parsed.get(k) != v]
    if missing:
        _warn_once(
            f"transport:{requested}:flags",
            f"parallel.transport={requested} needs XLA flag(s) {' '.join(missing)}, which the running "
            f"backend did not start with; {_FIX.format(flags=' '.join(missing))}",
        )
    if record.ragged_preset is None:  # no ragged all-to-all: the preset does not matter
        return requested
    if record.ragged_preset == "default":  # insists on XLA's one-shot kernel
        effective = effective_preset(flags)
        if effective != "default":
            _warn_once(
                f"transport:{requested}",
                f"parallel.transport={requested} feeds XLA's one-shot ragged all-to-all kernel, but the backend "
                f"started with the {effective!r} ragged preset ("
                + ("the decomposer pads every chunk to the receive buffer on the wire" if effective == "decomposer"
                   else "the NCCL send/recv fallback, which hung in our runs")
                + f"); unset XMOE_RAGGED_A2A and the ragged flags in XLA_FLAGS, or use parallel.transport={record.fallback}",
            )  # fmt: skip
        return requested
    preset = wanted_preset()
    missing = [f"--{k}={v}" for k, v in RAGGED_A2A_PRESETS[preset].items() if parsed.get(k) != v]
    if missing:
        _warn_once(
            f"transport:{requested}",
            f"XMOE_RAGGED_A2A={preset} needs XLA flag(s) {' '.join(missing)}, which the running backend did "
            f"not start with (added after it started, or XLA_FLAGS sets them otherwise); "
            f"parallel.transport={requested} runs XLA's {effective_preset(flags)!r} ragged all-to-all kernel "
            f"(2.7 GB/s measured, 30x slower than the decomposer). To use it: {_FIX.format(flags=' '.join(missing))}",
        )
    return requested


def check_scheduler(wanted: str, backend: str, flags: str | None = None) -> bool:
    """Whether `parallel.xla_scheduler=wanted` took effect on `backend`; on GPU, one warning naming
    the flag and the fix when it did not (off GPU the scheduler flags do nothing: always true)."""
    if backend not in GPU_BACKENDS or effective_scheduler(flags) == wanted:
        return True
    want = " ".join(f"--{k}={v}" for k, v in SCHEDULER_PRESETS["latency_hiding"].items())
    _warn_once(
        f"scheduler:{wanted}",
        f"parallel.xla_scheduler={wanted} did not take effect (the running backend started with "
        f"XLA_FLAGS={effective_flags() if flags is None else flags!r}); to change it: "
        f"{_FIX.format(flags=want)} (or set XMOE_XLA_SCHEDULER={wanted} for the scripts)",
    )
    return False
