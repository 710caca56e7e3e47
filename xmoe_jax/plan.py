"""Memory planner: what one device holds when a config trains on N devices.

    xmoe-plan --config configs/large.yaml --devices 256 [--device-memory 64GiB] [--set ...]

Steps:
  1. resolve the config on N devices (the mesh's `data=-1` fills the rest) and check it;
  2. build the train step exactly as the trainer first compiles it (dropless pft/rbd with
     adaptive buffers: the ladder's first rung, factor 1.2 unless set) and compile it ahead of
     time for that mesh: N fake CPU devices (XLA:CPU), or the real GPUs of this host with
     `--real-devices`; nothing runs;
  3. per device: parameters, router biases and optimizer state from their shardings
     (exact), gradients (the size of the parameters; they live among the step's
     temporaries), temporaries from `compiled.memory_analysis()`, and the state in bytes
     per parameter (`state_bytes_per_param`);
  4. the peak, arguments + temporaries + outputs - donated (aliased) bytes, against the
     device memory; if it does not fit, which settings to change.

On CPU the grouped GEMMs compile as the Pallas kernels (interpret mode, XMOE_KERNELS),
the same buffers as on a GPU, not XLA's dense `ragged_dot` lowering whose workspace
is several times larger, and `parallel.transport: auto` compiles as a GPU resolves it
(`bucketed`), not as CPU's exact emulation whose padded [peers, tokens, D] chunks would
dominate the plan; the attention's temporaries are XLA's, not cuDNN's. JAX
cannot compile for a GPU without one, so CPU figures are an estimate whose distance to
the GPU compile is measured in benchmarks/scale.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from xmoe_jax import sharding
from xmoe_jax.config import Config, MeshShape
from xmoe_jax.moe.dispatchers import exchanges_tokens
from xmoe_jax.train import weight_copy

GiB = 2**30


def compiled_peak(mem) -> int:
    """Per-device bytes a compiled step holds at its peak, from its `memory_analysis()`: arguments +
    temporaries + outputs - donated (outputs written into donated inputs)."""
    return (
        mem.argument_size_in_bytes
        + mem.temp_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
    )


def _per_device(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass
class Plan:
    devices: int
    mesh: MeshShape
    backend: str
    params: int
    bias: int
    optimizer: int
    gradients: int
    temporaries: int
    arguments: int
    outputs: int
    aliased: int
    compile_s: float
    device_memory: int | None
    advice: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)
    bytes_per_param: dict[str, float] = dataclasses.field(default_factory=dict)  # `state_bytes_per_param`

    @property
    def state(self) -> int:
        return self.params + self.bias + self.optimizer

    @property
    def peak(self) -> int:
        """Arguments + temporaries + outputs - donated bytes (outputs written into donated inputs)."""
        return self.arguments + self.temporaries + self.outputs - self.aliased

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak <= self.device_memory

    def table(self) -> str:
        m = self.mesh
        rows = [
            ("parameters (float32 masters)", self.params),
            ("router biases", self.bias),
            ("optimizer state", self.optimizer),
            ("gradients (within temporaries)", self.gradients),
            ("activations / temporaries", self.temporaries),
            ("peak: arguments + temporaries + outputs - donated", self.peak),
        ]
        lines = [
            f"{self.devices} devices ({self.backend}); mesh data={m.data} expert={m.expert} "
            f"(nodes {m.expert_nodes}) tensor={m.tensor}; compiled in {self.compile_s:.0f} s",
            *(f"  {name:<52} {value / GiB:9.2f} GiB" for name, value in rows),
        ]
        if self.bytes_per_param:
            parts = " + ".join(f"{k} {v:.1f}" for k, v in self.bytes_per_param.items())
            lines.append(
                f"  {'state, bytes per parameter':<52} {parts} = {sum(self.bytes_per_param.values()):.1f}"
            )
        if self.device_memory is not None:
            over = f", {(self.peak - self.device_memory) / GiB:.1f} GiB over" if not self.fits else ""
            verdict = "fits" if self.fits else f"does NOT fit{over}"
            lines.append(f"  {'device memory':<52} {self.device_memory / GiB:9.2f} GiB: {verdict}")
        lines += [f"  try: {a}" for a in self.advice]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mesh"},
            "mesh": self.mesh._asdict(),
            "state": self.state,
            "peak": self.peak,
            "fits": self.fits,
        }


def state_bytes_per_param(cfg: Config, state) -> dict[str, float]:
    """The train state in bytes per parameter (per device: sharding cancels out): `params` (their
    dtype), `moments` (AdamW's two, in optimizer.state_dtype, with its step counter), `gradients`
    (the params' dtype; a copied weight's in its copy's) and `accumulators` (sums of micro-batch gradients
    in train.grad_accum_dtype with train.micro_batch_size < batch_size, train/step.py; 0 without); with
    `train.weight_copy` in effect (one device), `copies` (the bf16 copies, train/weight_copy.py) too."""
    count = sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(state.params))
    micro = cfg.train.micro_batch_size
    out = {
        "params": _per_device(state.params) / count,
        "moments": _per_device(state.opt) / count,
        "gradients": _per_device(weight_copy.merged(state.params, state.weights)) / count,
        "accumulators": (
            float(jax.numpy.dtype(cfg.train.grad_accum_dtype).itemsize)
            if micro is not None and micro < cfg.train.batch_size
            else 0.0
        ),
    }
    if state.weights is not None:
        out["copies"] = _per_device(state.weights) / count
    return out


def advise(cfg: Config, plan: Plan) -> list[str]:
    """Settings that cut the larger share of a plan that does not fit."""
    if plan.fits is not False:
        return []
    out = []
    over = plan.peak - plan.device_memory
    if not cfg.mesh.fsdp and plan.mesh.data > 1:
        out.append("mesh.fsdp=true: parameters and optimizer state split over the data axis")
    elif not cfg.mesh.fsdp and plan.state > over:
        out.append("a data axis with mesh.fsdp=true (fewer expert or tensor ranks): state split over data")
    if cfg.model.moe is not None and cfg.model.moe.num_experts % (2 * plan.mesh.expert) == 0:
        out.append(f"mesh.expert={2 * plan.mesh.expert}: half the experts per device")
    if cfg.model.remat == "none":
        out.append("model.remat=save_dots (or full): keep fewer activations per layer")
    elif cfg.model.remat != "full":
        out.append("model.remat=full: keep only each block's input")
    micro = cfg.train.micro_batch_size or cfg.train.batch_size
    if micro > plan.mesh.batch_shards and micro % 2 == 0 and (micro // 2) % plan.mesh.batch_shards == 0:
        out.append(f"train.micro_batch_size={micro // 2}: half the activations per micro-batch")
    if plan.mesh.tensor > 1 and not cfg.parallel.ssmb:
        out.append("parallel.ssmb=true: the MoE block's buffers fall by the tensor factor")
    moe_exchange = cfg.model.moe is not None and exchanges_tokens(cfg.parallel.dispatch)
    if moe_exchange and cfg.parallel.recv_buffer_factor is None:
        out.append(
            "parallel.recv_buffer_factor=1.2 (with parallel.adaptive_buffers=true): buffers near the average"
        )
    return out


def as_trained(cfg: Config, shape: MeshShape, on_cpu: bool) -> tuple[Config, list[str]]:
    """The config whose step the trainer compiles first (step 2), and what changed: the run's
    placement settled as the trainer settles it (xmoe_jax/resolve.py), for a GPU when planning on
    CPU."""
    from xmoe_jax.resolve import resolve_placement

    placed = resolve_placement(cfg, shape.expert, backend="gpu" if on_cpu else None)
    notes = []
    if placed.parallel.recv_buffer_factor != cfg.parallel.recv_buffer_factor:
        notes.append(
            f"receive buffers at {placed.parallel.recv_buffer_factor}x the average load, where adaptive "
            "buffers start (parallel.adaptive_buffers=false plans the fixed factor, null = the worst case)"
        )
    if on_cpu and placed.parallel.transport != cfg.parallel.transport:  # `auto`, settled for a GPU
        notes.append(
            f"transport {cfg.parallel.transport} compiled as on a GPU ({placed.parallel.transport}), "
            "not as on this CPU"
        )
    return placed, notes


@contextlib.contextmanager
def ticking(progress: Callable[[str], None] | None, what: str, every_s: float = 15.0) -> Iterator[None]:
    """`progress(what...)` now and `progress(still what (N s))` every `every_s` seconds until the block
    ends: a compile of a large config takes minutes, and a silent tool looks hung."""
    if progress is None:
        yield
        return
    progress(f"{what}...")
    done, t0 = threading.Event(), time.perf_counter()

    def tick() -> None:
        while not done.wait(every_s):
            progress(f"still {what} ({time.perf_counter() - t0:.0f} s)")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def plan(
    cfg: Config, device_memory: int | None = None, progress: Callable[[str], None] | None = None
) -> Plan:
    """Compile cfg's train step for the devices JAX has and read back its memory; `progress` (a
    line printer, or None) hears each stage and, while the compile runs, a line every 15 s."""
    from xmoe_jax.train import state as tstate
    from xmoe_jax.train.step import batch_sharding, make_train_step

    devices = jax.device_count()
    shape = cfg.validate_for_devices(devices)
    cfg, notes = as_trained(cfg, shape, jax.devices()[0].platform == "cpu")
    mesh = sharding.make_mesh(cfg.mesh)  # adaptive buffers: as_trained planned the rung training starts on
    with ticking(progress, "building the train state's shapes and shardings"):
        layout = tstate.build(cfg, mesh)
        spec, optimizer, shardings, state = layout.spec, layout.optimizer, layout.shardings, layout.abstract()
    data_sh = batch_sharding(mesh, cfg)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), np.int32, sharding=data_sh)
    step = make_train_step(spec, optimizer, cfg, mesh, shardings)
    t0 = time.perf_counter()
    m = shape
    what = (
        f"compiling the train step for {devices} devices (data={m.data} expert={m.expert} tensor={m.tensor})"
    )
    with ticking(progress, what), jax.set_mesh(mesh):
        compiled = step.lower(state, {"inputs": tokens, "targets": tokens}).compile()
    compile_s = time.perf_counter() - t0
    if progress is not None:
        progress(f"compiled in {compile_s:.0f} s")
    mem = compiled.memory_analysis()
    dev = jax.devices()[0]
    backend = (
        "fake CPU devices, XLA:CPU compile" if dev.platform == "cpu" else f"{dev.device_kind}, real compile"
    )
    params = _per_device(state.params)
    result = Plan(
        devices=devices,
        mesh=shape,
        backend=backend,
        params=params,
        bias=_per_device(state.bias),
        optimizer=_per_device(state.opt),
        gradients=params,  # in the params' dtype
        temporaries=int(mem.temp_size_in_bytes),
        arguments=int(mem.argument_size_in_bytes),
        outputs=int(mem.output_size_in_bytes),
        aliased=int(mem.alias_size_in_bytes),
        compile_s=compile_s,
        device_memory=device_memory,
        advice=[],
        notes=notes,
        bytes_per_param=state_bytes_per_param(cfg, state),
    )
    result.advice = advise(cfg, result)
    return result
