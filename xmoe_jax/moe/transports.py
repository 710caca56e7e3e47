"""The transports, one table: how pft/rbd move routed rows between devices, and what each needs.

Each `Transport` record holds one transport's facts: the buffer layout it serves, what it puts on
the wire, the function that moves the rows, the platforms and process layouts it runs on, the XLA
flags it wants, the transport that stands in where it cannot run (`fallback`), and how `auto` ranks
it. Code outside this module asks a record (`transport.layout == "chunked"`, `transport.wire`),
never compares transport names (tests/test_transports.py greps for that). Adding a transport is
adding one entry to `TABLE` (and its name to `config.choices.Transport`).

docs/exchange.md shows the table (`markdown_table()` renders it; tests/test_transports.py keeps
the two equal).

`auto` is settled once per run at start-up (xmoe_jax/resolve.py) by `choose`: the best-ranked
transport whose `auto_on` holds the platform and which serves the run's process layout. A transport
asked for by name on a platform or process layout it does not serve is refused there in one line
naming its fallback (`refusal`), built from the record's facts.

Layouts (moe/layouts.py): `compact` is a ragged exchange (exchange.Plan) into one static receive
buffer per device, moved by the record's `move`; `chunked` is P fixed chunks per device moved by
one dense all_to_all (layouts.chunked), so its `move` is None. Wire (exchange.wire_bytes): `exact`
sends only the routed rows (unless XLA decomposes its ragged all-to-all: `ragged_preset` set and
`parallel.ragged_decomposed`); `padded` sends every per-peer chunk padded to a static bound.

Process layouts (`process_layout`): `one` (one process drives every device), `per_host` (one process
per host drives all of that host's GPUs), `per_device` (several processes per host, e.g. one per GPU).
Off GPU the collectives serve every layout, so only `gpu_processes` is recorded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import jax

from xmoe_jax.moe.exchange import (
    move_emulated,
    move_exact,
    move_push,
    move_push_arrive,
    move_push_gmm,
    move_ragged,
)

AUTO = "auto"  # the request, not a transport: settled by `choose`
GPUS = ("cuda", "rocm")
ONE, PER_HOST, PER_DEVICE = "one", "per_host", "per_device"
PROCESS_LAYOUTS = (ONE, PER_HOST, PER_DEVICE)
_LAYOUT_WORDS = {
    ONE: "one process driving every GPU",
    PER_HOST: "one process per host driving all of its GPUs",
    PER_DEVICE: "several processes per host",
}


@dataclass(frozen=True)
class Transport:
    """One transport's facts (module docstring). Hashable: it travels as a static argument."""

    name: str
    layout: Literal["compact", "chunked"]
    wire: Literal["exact", "padded"]
    # compact: (x_ND, plan, out_rows, axis_name, max_chunk) -> [out_rows, D]; chunked: None
    move: Callable | None
    runs: str  # what moves the rows, in a phrase (refusals name it)
    platforms: tuple[str, ...] | None = None  # None: every platform JAX runs on
    gpu_processes: tuple[str, ...] = PROCESS_LAYOUTS
    # runs jax.lax.ragged_all_to_all: the XLA preset it wants (launch/xla_flags.RAGGED_A2A_PRESETS;
    # `default` = XLA's own kernel, insisted on; another = the library default, XMOE_RAGGED_A2A wins)
    ragged_preset: str | None = None
    xla_flags: tuple[tuple[str, str], ...] = ()  # (flag, value) it needs, added before JAX starts
    fallback: str | None = None  # what serves where it cannot run
    across_nodes: str | None = None  # rbd's cross-node stage (a compact exchange): None = itself
    auto_on: tuple[str, ...] | None = ()  # platforms where `auto` may pick it (None: every one)
    auto_rank: int = 0  # among those, the lowest wins
    buffers_shrink: bool = True  # the buffer ladder may shrink its buffers (False: grows only, rarely)
    # compact layout: how received rows land. `source`: in (source, local expert) order, read by the
    # experts through an index; `expert`: grouped by local expert (one update per peer and local
    # expert), so the experts' GEMMs read and write them in place (layouts.compact)
    arrival: Literal["source", "expert"] = "source"
    # expert-major arrival's return, run inside the down-projection's grouped GEMM (exchange.py):
    # (lhs_RF, rhs_EFD, group_sizes_E, plan, out_rows, axis_name, max_chunk) -> [out_rows, D]; None: the
    # GEMM and then `move`
    gmm_move: Callable | None = None
    # expert-major arrival's dispatch (and the backward's cotangent), run with the grouped GEMM after it
    # in one kernel (exchange.py): (x_ND, plan, out_rows, axis_name, max_chunk, rhs_EKN, group_sizes_E,
    # transpose_rhs) -> ([out_rows, D] received, [out_rows, N] GEMM); None: `move` and then the GEMM
    arrive_gmm: Callable | None = None

    def runs_on(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms

    def serves(self, platform: str, processes: str) -> bool:
        return self.runs_on(platform) and (platform not in GPUS or processes in self.gpu_processes)

    def node_stage(self) -> Transport:
        """The transport of rbd's stage 1 (a ragged exchange of pilots across nodes) under this one."""
        return get(self.across_nodes) if self.across_nodes else self


TABLE: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "bucketed",
            layout="chunked",
            wire="padded",
            move=None,
            runs="a dense all_to_all of per-peer chunks",
            across_nodes="emulated",
            auto_on=GPUS,
            auto_rank=1,  # the fastest measured on GPU (benchmarks/exchange.md)
        ),
        Transport(
            "exact",
            layout="compact",
            wire="exact",
            move=move_exact,
            runs="XLA's one-shot ragged all-to-all kernel (XLA refuses it across processes: "
            "'fallback to NCCL is not allowed')",
            gpu_processes=(ONE,),
            ragged_preset="default",
            fallback="bucketed",
        ),
        Transport(
            "ragged",
            layout="compact",
            wire="exact",
            move=move_ragged,
            runs="jax.lax.ragged_all_to_all (XLA:CPU has none)",
            platforms=(*GPUS, "tpu"),
            ragged_preset="decomposer",
            fallback="emulated",
        ),
        Transport(
            "push",
            layout="compact",
            wire="exact",
            move=move_push,
            runs="our Pallas Mosaic-GPU kernel, which writes rows into the peers' receive buffers "
            "(NVIDIA Hopper; the peers' addresses reach one process only, without NVSHMEM)",
            platforms=("cuda", "cpu"),  # on CPU its XLA reference runs the same plan (the tests)
            gpu_processes=(ONE,),
            fallback="bucketed",
            across_nodes="emulated",
            buffers_shrink=False,  # one receive buffer per run: grown on overflow, never shrunk
            arrival="expert",  # its updates are cheap to split per local expert (benchmarks/exchange.md)
            gmm_move=move_push_gmm,  # the down-projection's epilogue pushes its rows (kernels/push: gmm_push)
            arrive_gmm=move_push_arrive,  # the GEMM after the exchange waits per group (kernels/push: push_gmm)
        ),
        Transport(
            "emulated",
            layout="compact",
            wire="padded",
            move=move_emulated,
            runs="a dense all_to_all of chunks padded to a static bound",
            auto_on=None,
            auto_rank=9,  # the last resort: runs everywhere (and is the CPU tests' exact oracle path)
        ),
    )
}


def get(name: str) -> Transport:
    """The record of concrete transport `name` (`auto` is settled first: `choose`)."""
    if name not in TABLE:
        settle = " (settle it first: xmoe_jax.resolve.resolve_parallel)" if name == AUTO else ""
        raise ValueError(f"parallel.transport={name!r} is not one of {sorted(TABLE)}{settle}")
    return TABLE[name]


def platform_of(backend: str | None = None) -> str:
    """`cpu`, `cuda`, `rocm`, `tpu`... for JAX `backend` (default: the running one). JAX calls both
    GPUs `gpu`: the running devices tell which; a GPU planned on another platform counts as CUDA."""
    running = jax.default_backend()
    backend = backend or running
    if backend != "gpu":
        return backend
    client = getattr(jax.devices()[0], "client", None) if running == "gpu" else None
    return "rocm" if "rocm" in str(getattr(client, "platform_version", "")).lower() else "cuda"


def process_layout() -> str:
    """This run's process layout (module docstring): a process that drives several devices is taken
    to drive all of its host's."""
    if jax.process_count() == 1:
        return ONE
    return PER_HOST if jax.local_device_count() > 1 else PER_DEVICE


def choose(requested: str, platform: str | None = None, processes: str | None = None) -> Transport:
    """The transport for `parallel.transport=requested`: its record, or for `auto` the best-ranked
    one `auto` may pick on `platform` that serves `processes` (defaults: this run's). Runs settle
    this once at start-up (xmoe_jax/resolve.py); a library call that left `auto` gets the same rule."""
    if requested != AUTO:
        return get(requested)
    platform = platform or platform_of()
    processes = processes or process_layout()
    picks = [
        t
        for t in TABLE.values()
        if (t.auto_on is None or platform in t.auto_on) and t.serves(platform, processes)
    ]
    if not picks:
        raise ValueError(
            f"parallel.transport=auto: no transport serves {platform} with {processes} processes"
        )
    return min(picks, key=lambda t: t.auto_rank)


def refusal(t: Transport, platform: str, processes: str, num_processes: int = 1) -> str | None:
    """Why `t` cannot run on `platform` with `processes`, naming its fallback (None: it can)."""
    if t.serves(platform, processes):
        return None
    if not t.runs_on(platform):
        need, have = f"serves {', '.join(t.platforms or ())} only", f"this run is on {platform}"
    else:
        need = f"needs {' or '.join(_LAYOUT_WORDS[p] for p in t.gpu_processes)}"
        have = f"this run has {num_processes} processes ({_LAYOUT_WORDS[processes]})"
    return f"parallel.transport={t.name} runs {t.runs}, which {need}; {have}; use parallel.transport={t.fallback} (or auto)"


ARRIVAL_ENV = "XMOE_ARRIVAL"  # `source`: a transport that lands rows expert-major lands them source-major


def arrival(t: Transport) -> str:
    """How `t`'s received rows land (`source` or `expert`; the record's `arrival`).
    XMOE_ARRIVAL=source turns expert-major arrival off, for measuring it against the other."""
    forced = os.environ.get(ARRIVAL_ENV) or None
    if forced not in (None, "source"):
        raise ValueError(
            f"{ARRIVAL_ENV}={forced!r}: use source (or unset it for each transport's own arrival)"
        )
    return forced or t.arrival


FUSED_RETURN_ENV = "XMOE_FUSED_RETURN"  # `off`: the return exchange runs after the GEMM, not inside it


def gmm_move(t: Transport) -> Callable | None:
    """`t`'s return inside the down-projection (the record's `gmm_move`; only with expert-major
    arrival, whose rows are grouped), or None. XMOE_FUSED_RETURN=off turns it off, for measuring."""
    forced = os.environ.get(FUSED_RETURN_ENV) or None
    if forced not in (None, "off"):
        raise ValueError(f"{FUSED_RETURN_ENV}={forced!r}: use off (or unset it for each transport's own)")
    return None if forced or arrival(t) != "expert" else t.gmm_move


FUSED_ARRIVE_ENV = "XMOE_FUSED_ARRIVE"  # `on`: the exchange before a GEMM runs inside it


def arrive_gmm(t: Transport) -> Callable | None:
    """`t`'s exchange inside the GEMM after it (the record's `arrive_gmm`; only with expert-major
    arrival and the return fused, `gmm_move`), or None. Opt-in (XMOE_FUSED_ARRIVE=on) until it has been
    measured on a GPU (docs/exchange.md)."""
    wanted = os.environ.get(FUSED_ARRIVE_ENV) or None
    if wanted not in (None, "on", "off"):
        raise ValueError(f"{FUSED_ARRIVE_ENV}={wanted!r}: use on or off")
    return t.arrive_gmm if wanted == "on" and gmm_move(t) else None


def ragged_preset(requested: str) -> str | None:
    """The ragged all-to-all preset `requested` asks for (None: no preference, the library default).
    `auto`: the best-ranked preset among the transports it may pick, else XLA's own (`default`: no
    flag added), since XLA reads its flags before the platform and the process layout are known."""
    if requested != AUTO:
        return get(requested).ragged_preset
    wanted = [
        t for t in sorted(TABLE.values(), key=lambda t: t.auto_rank) if t.auto_on != () and t.ragged_preset
    ]
    return wanted[0].ragged_preset if wanted else "default"


def xla_flags(requested: str) -> dict[str, str]:
    """The XLA flags `requested` needs; `auto`: those of every transport it may pick (see above)."""
    picks = [t for t in TABLE.values() if t.auto_on != ()] if requested == AUTO else [get(requested)]
    return {flag: value for t in picks for flag, value in t.xla_flags}


def markdown_table() -> str:
    """The table as docs/exchange.md shows it."""

    def words(values: tuple[str, ...] | None, every: tuple[str, ...] | None = None) -> str:
        return "every" if values is None or values == every else ", ".join(values)

    rows = [
        "| transport | layout | arrival | wire | platforms | processes on GPU | XLA preset, flags | fallback | auto |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in TABLE.values():
        flags = [t.ragged_preset] if t.ragged_preset else []
        flags += [f"`--{k}={v}`" for k, v in t.xla_flags]
        auto = "never" if t.auto_on == () else f"{words(t.auto_on)} (rank {t.auto_rank})"
        rows.append(
            f"| `{t.name}` | {t.layout} | {t.arrival if t.layout == 'compact' else '-'} | {t.wire} | {words(t.platforms)} | "
            f"{words(t.gpu_processes, PROCESS_LAYOUTS)} | {', '.join(flags) or '-'} | "
            f"{f'`{t.fallback}`' if t.fallback else '-'} | {auto} |"
        )
    return "\n".join(rows)
