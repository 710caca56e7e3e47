"""Placement settled once at start-up, before anything is traced.

The trainer, the evaluator, the generator and the memory planner build their steps from
`resolve_placement(cfg, exchange_devices)`; the config a run saves keeps what the user wrote. Steps:
  1. `parallel.transport: auto` becomes the concrete exchange for the platform and the process
     layout, settled here once from the table of transports (moe/transports.py: `bucketed` on
     GPU, `emulated` elsewhere); a transport that cannot serve the run's platform or process
     layout is refused in one line naming its fallback (the record's facts: `exact` with several
     processes on GPU, `ragged` on CPU); an explicit `ragged` whose XLA flags
     did not take effect is named here, in one warning (xla_flags.transport_for), not while
     tracing; and whether XLA decomposes the ragged all-to-all (the `decomposer` preset in the
     flags the backend started with) is recorded as `parallel.ragged_decomposed`, so moe/ never
     reads XLA flags (`resolve_parallel`, which direct library callers such as perf/ use too);
  2. dropless pft/rbd training with adaptive buffers starts on the ladder's first rung
     (moe/ladder.py), so the planner compiles the step the trainer compiles first;
  3. a run that asks for the `dense` oracle (every expert on every token) beyond a toy size is
     told once what that costs (`warn_dense_oracle`). `parallel.dispatch: auto` is already `pft`
     here: `Config` settles it (config/parallel.py).
Code outside moe/ asks the dispatcher table whether a mode exchanges tokens
(`moe.dispatchers.exchanges_tokens`) instead of comparing dispatch names.

`ONE_DEVICE` names the placement that runs a model on one device, whatever mesh it trained on
(generation's default): a 1x1x1 mesh, no FSDP, every placement switch at its default (`auto`
dispatch: pft on one device, no exchange) (a run's pft/rbd or tensor switches cannot apply there and are refused: config/applies.py),
and no FP8 (its expert and dispatch parts need pft; parameters are the same with FP8 on or off).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from xmoe_jax import sharding
from xmoe_jax.config import Config, ConfigError, ParallelConfig
from xmoe_jax.launch import xla_flags
from xmoe_jax.moe import transports
from xmoe_jax.moe.ladder import BufferLadder, applies

log = logging.getLogger("xmoe_jax")
# `dense` beyond these (experts; tokens per device per micro-batch) is told what it costs
TOY_EXPERTS, TOY_TOKENS = 16, 8192
_warned: set[str] = set()

# dotted key -> value: one device, whatever the run's mesh and placement were
ONE_DEVICE: dict[str, object] = {
    "mesh.data": 1,
    "mesh.expert": 1,
    "mesh.tensor": 1,
    "mesh.expert_nodes": 1,
    "mesh.fsdp": False,
    **{f"parallel.{f.name}": f.default for f in dataclasses.fields(ParallelConfig)},  # dispatch: auto
    "model.fp8": None,
}


def one_device_overrides() -> list[str]:
    """`ONE_DEVICE` as dotted overrides (`--set` syntax), to go before the user's own."""
    return [
        f"{key}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}"
        for key, value in ONE_DEVICE.items()
    ]


def exchange_devices(mesh) -> int:
    """Devices that exchange tokens with each other: the expert axes of `mesh` (1 without one)."""
    return sharding.axis_size(mesh, sharding.EXPERT_AXES)


def resolve_transport(requested: str, backend: str | None = None) -> transports.Transport:
    """The record of `parallel.transport=requested` on `backend` (default: JAX's) with this run's
    process layout: `auto` settled by the table's ranking (moe/transports.choose), the rest as named."""
    return transports.choose(requested, transports.platform_of(backend), transports.process_layout())


def resolve_parallel(parallel: ParallelConfig, backend: str | None = None) -> ParallelConfig:
    """`parallel` with its exchange settled for `backend` (default: JAX's): a concrete transport and
    the XLA flags' effect on it recorded (step 1 of the module docstring, without the warning or the
    refusal)."""
    return dataclasses.replace(
        parallel,
        transport=resolve_transport(parallel.transport, backend).name,
        ragged_decomposed=xla_flags.effective_preset() == "decomposer",
    )


def resolve_placement(cfg: Config, num_exchange_devices: int, backend: str | None = None) -> Config:
    """`cfg` with its placement settled for `num_exchange_devices` (`exchange_devices(mesh)`) on
    `backend` (default: JAX's): steps 1-2 of the module docstring. The planner passes
    backend="gpu" to plan a GPU run on CPU."""
    if cfg.model.moe is None:
        return cfg
    parallel = resolve_parallel(cfg.parallel, backend or jax.default_backend())
    platform, processes = transports.platform_of(backend), transports.process_layout()
    why = transports.refusal(transports.get(parallel.transport), platform, processes, jax.process_count())
    if why:
        raise ConfigError(why)
    # ragged: one warning if this process's XLA flags did not take effect (a concrete choice passes)
    xla_flags.transport_for(parallel.transport, jax.default_backend())
    warn_dense_oracle(cfg, jax.device_count())
    ladder = BufferLadder(parallel, applies(cfg, num_exchange_devices))
    if ladder.active:
        parallel = ladder.parallel  # its first rung
    return dataclasses.replace(cfg, parallel=parallel)


def warn_dense_oracle(cfg: Config, num_devices: int) -> str | None:
    """Step 3: under `parallel.dispatch=dense` every expert runs on every token (moe/dense.py: memory
    O(E*T*(D+F))). Beyond TOY_EXPERTS experts or TOY_TOKENS tokens per device, one warning (once
    per process) gives the expert activations of one MoE layer's forward pass; returns it."""
    moe, train = cfg.model.moe, cfg.train
    if moe is None or cfg.parallel.dispatch != "dense":
        return None
    shards = max(num_devices // cfg.mesh.tensor, 1)  # data x expert: the batch's split
    tokens = max((train.micro_batch_size or train.batch_size) * train.seq_len // shards, 1)
    if moe.num_experts <= TOY_EXPERTS and tokens <= TOY_TOKENS:
        return None
    hidden = moe.expert_hidden * (2 if moe.activation == "swiglu" else 1)
    per_token = 3 * cfg.model.hidden + hidden + moe.expert_hidden  # x and y (D, f32 D), up/gate, act
    experts = moe.num_experts // cfg.mesh.expert
    gib = experts * tokens * per_token * jnp.dtype(cfg.model.dtype).itemsize / 2**30
    size = f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"
    message = (
        f"parallel.dispatch=dense is the test oracle: it runs all {moe.num_experts} experts on every "
        f"token, about {size} of expert activations per MoE layer per device in the forward "
        f"pass ({experts} experts x {tokens} tokens, vs top_k={moe.top_k}); set parallel.dispatch=auto "
        "(pft: padding-free, dropless) to run only the chosen experts"
    )
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
    return message
