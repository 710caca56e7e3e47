"""Manual (shard_map) vs automatic (partitioner) sharding of the MoE layer, compared from compiled code.

Used by scripts/compare_sharding.py. For one MoE config, a token count and a mesh,
each variant below is compiled as a jitted forward+backward of one MoE layer (and,
optionally, of a whole model), and read back:
  memory:      `compiled.memory_analysis()` per device: temp (activations and
               workspace), arguments, outputs; peak = their sum less aliasing;
  model:       the analytic estimate of xmoe_jax.perf.memory_model (pft variants:
               forward+backward peak; padded: ideal buffer inventory);
  collectives: ops and the bytes of their results in the optimized HLO
               (xmoe_jax.perf.hlo.collective_stats), per device; collectives over
               one-device groups (psums over size-1 axes) are left out;
  time:        on GPU, the median step time (xmoe_jax.perf.timing.time_fn).

Variants (`VARIANTS`; each one a set of ParallelConfig overrides):
  pft+ssmb     manual: pft inside shard_map, tokens split over data x expert x tensor;
  pft          manual: pft inside shard_map, tokens replicated over tensor (no SSMB);
  pft+etp      manual: expert-tensor parallel (each expert's F split over tensor);
  pft-auto     automatic: the same padding-free algorithm (sort into one flat buffer,
               grouped GEMMs) on the whole batch under jit, with only logical sharding
               annotations (tokens over data x expert x tensor, experts over expert):
               no shard_map, no explicit collectives; XLA's partitioner places it;
  padded-auto  automatic: the capacity baseline ([E, C, D] buffers, C from the whole
               batch) under the same annotations; `padded` in the MoE config;
  dense-auto   automatic: the dense oracle (every expert on every token), opt-in.
Every variant takes the tokens laid out as the model hands them to the block (split
over data x expert, replicated over tensor) and returns them the same way, so the
SSMB variants pay for their all-gather after the block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xmoe_jax import sharding
from xmoe_jax.config import ModelConfig, MoEConfig, ParallelConfig
from xmoe_jax.kernels import default_implementation
from xmoe_jax.moe import init_moe_params, moe_layer
from xmoe_jax.moe.params import EXPERT_AXES
from xmoe_jax.perf import memory_model as mm
from xmoe_jax.perf.hlo import collective_stats
from xmoe_jax.perf.timing import time_fn
from xmoe_jax.resolve import resolve_transport

MiB = 2**20


@dataclass(frozen=True)
class Variant:
    name: str
    placement: str  # "manual" (shard_map) or "auto" (partitioner)
    overrides: dict = field(default_factory=dict)


_OFF = {"ssmb": False, "expert_tensor_parallel": False, "auto_shard": False}
VARIANTS = {
    "pft+ssmb": Variant("pft+ssmb", "manual", {**_OFF, "dispatch": "pft", "ssmb": True}),
    "pft": Variant("pft", "manual", {**_OFF, "dispatch": "pft"}),
    "pft+etp": Variant("pft+etp", "manual", {**_OFF, "dispatch": "pft", "expert_tensor_parallel": True}),
    "pft-auto": Variant("pft-auto", "auto", {**_OFF, "dispatch": "pft", "auto_shard": True, "ssmb": True}),
    "padded-auto": Variant("padded-auto", "auto", {**_OFF, "dispatch": "padded", "ssmb": True}),
    "dense-auto": Variant("dense-auto", "auto", {**_OFF, "dispatch": "dense", "ssmb": True}),
}
DEFAULT_VARIANTS = ("pft+ssmb", "pft", "pft+etp", "pft-auto", "padded-auto")


def variant_parallel(parallel: ParallelConfig, variant: Variant) -> ParallelConfig:
    return dataclasses.replace(parallel, **variant.overrides)


def _memory(compiled) -> dict:
    mem = compiled.memory_analysis()
    if mem is None:
        return {}
    out = {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }
    # arguments + outputs + temporaries bound the peak (XLA:CPU's own peak figure leaves out temps)
    out["peak_bytes"] = out["temp_bytes"] + out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
    out["xla_peak_bytes"] = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    return out


def _collectives(compiled) -> dict:
    stats = collective_stats(compiled.as_text())
    return {
        "collectives": stats,
        "collective_count": sum(s["count"] for s in stats.values()),
        "collective_bytes": sum(s["bytes"] for s in stats.values()),
    }


def _layer_shardings(parallel: ParallelConfig, params, mesh: Mesh):
    """Expert weights over expert (F over tensor with expert-TP), the rest replicated."""
    rules = sharding.param_rules(expert_tensor_parallel=parallel.expert_tensor_parallel)
    rep = NamedSharding(mesh, PartitionSpec())
    out = jax.tree.map(lambda _: rep, params)
    out["experts"] = {
        k: sharding.named_sharding(mesh, EXPERT_AXES[k], v.shape, rules) for k, v in params["experts"].items()
    }
    return out


def estimate(
    cfg: MoEConfig, parallel: ParallelConfig, dim: int, num_tokens: int, mesh: Mesh, itemsize: int
) -> int | None:
    """The memory model's figure for this variant (None where it has none)."""
    sizes = sharding.mesh_shape(mesh)
    if parallel.dispatch == "pft" and not parallel.auto_shard:
        gemm = "ragged_dot" if default_implementation("gmm") == "xla" else "kernel"
        transport = resolve_transport(parallel.transport).name
        return mm.pft_estimate(cfg, parallel, dim, num_tokens, sizes, itemsize, gemm, transport).peak
    if parallel.dispatch == "padded":
        return sum(mm.padded_buffers(cfg, parallel, dim, num_tokens, sizes, itemsize).values())
    return None


def layer_case(
    cfg: MoEConfig,
    parallel: ParallelConfig,
    dim: int,
    num_tokens: int,
    mesh: Mesh,
    dtype=jnp.float32,
    time_it: bool = False,
    iters: int = 10,
) -> dict:
    """Compiles one MoE layer forward+backward for `cfg` on `mesh` and reads it back."""
    params = jax.eval_shape(lambda: init_moe_params(jax.random.key(0), dim, cfg, dtype=dtype))
    p_sh = _layer_shardings(parallel, params, mesh)
    x_sh = sharding.named_sharding(mesh, ("tokens", "embed"), (num_tokens, dim), sharding.ACTIVATION_RULES)

    def objective(params, x_TD, r_TD):
        y_TD, stats = moe_layer(params, x_TD, cfg, parallel, mesh=mesh)
        y_TD = sharding.constrain(y_TD, mesh, ("tokens", "embed"))  # back to the model's layout
        return jnp.sum(y_TD.astype(jnp.float32) * r_TD.astype(jnp.float32)) + stats.aux_loss

    step = jax.jit(
        jax.value_and_grad(objective, argnums=(0, 1)),
        in_shardings=(p_sh, x_sh, x_sh),
        out_shardings=(NamedSharding(mesh, PartitionSpec()), (p_sh, x_sh)),
    )
    x_abs = jax.ShapeDtypeStruct((num_tokens, dim), dtype)
    compiled = step.lower(params, x_abs, x_abs).compile()
    out = {**_memory(compiled), **_collectives(compiled)}
    out["model_bytes"] = estimate(cfg, parallel, dim, num_tokens, mesh, jnp.dtype(dtype).itemsize)
    if time_it:
        kp, kx, kr = jax.random.split(jax.random.key(0), 3)
        p = jax.device_put(init_moe_params(kp, dim, cfg, std=0.02, dtype=dtype), p_sh)
        x = jax.device_put(jax.random.normal(kx, (num_tokens, dim), dtype), x_sh)
        r = jax.device_put(jax.random.normal(kr, (num_tokens, dim), dtype), x_sh)
        out["step_ms"] = 1e3 * time_fn(compiled, p, x, r, iters=iters)
    return out


def model_case(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    mesh: Mesh,
    batch: int,
    seq_len: int,
    time_it: bool = False,
    iters: int = 5,
) -> dict:
    """Compiles a whole model's loss forward+backward (no optimizer) and reads it back."""
    from xmoe_jax.model import functional as fmodel
    from xmoe_jax.train.step import stack_layers

    spec = fmodel.model_spec(model_cfg, parallel)
    p_sh, b_sh = fmodel.shardings(spec, mesh)
    tok_sh = sharding.named_sharding(mesh, ("batch", "seq"), (batch, seq_len), sharding.ACTIVATION_RULES)

    def loss(params, bias, tokens_BS):
        logits_BSV, stats = fmodel.apply(spec, params, bias, tokens_BS)
        logp = jax.nn.log_softmax(logits_BSV, axis=-1)
        ce = -jnp.take_along_axis(logp, jnp.roll(tokens_BS, -1, axis=1)[..., None], axis=-1).mean()
        stacked = stack_layers(stats)
        return ce + (stacked.aux_loss.sum() if stacked else 0.0)

    step = jax.jit(
        jax.value_and_grad(loss),
        in_shardings=(p_sh, b_sh, tok_sh),
        out_shardings=(NamedSharding(mesh, PartitionSpec()), p_sh),
    )
    tok_abs = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    with jax.set_mesh(mesh):
        compiled = step.lower(spec.params_shape, spec.bias_shape, tok_abs).compile()
    out = {**_memory(compiled), **_collectives(compiled)}
    if time_it:
        params, bias = fmodel.init_params(spec, jax.random.key(0), mesh)
        tokens = jax.device_put(
            jax.random.randint(jax.random.key(1), (batch, seq_len), 0, model_cfg.vocab_size), tok_sh
        )
        out["step_ms"] = 1e3 * time_fn(compiled, params, bias, tokens, iters=iters)
    return out


def compare(
    cfg: MoEConfig,
    dim: int,
    num_tokens: int,
    mesh: Mesh,
    variants=DEFAULT_VARIANTS,
    dtype=jnp.float32,
    time_it: bool = False,
    model_cfg: ModelConfig | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
    on_row=None,
    parallel: ParallelConfig | None = None,
) -> list[dict]:
    """One row per variant (and per variant a `model` row when `model_cfg` is given).

    Each variant overrides the placement of `parallel` (transport and receive buffers stay).
    `on_row(row)` is called as each row is done (progress output for long compiles).
    """
    parallel = parallel or ParallelConfig()
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    rows = []

    def add(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for name in variants:
        variant = VARIANTS[name]
        vpar = variant_parallel(parallel, variant)
        row = {"variant": name, "scope": "layer", "placement": variant.placement}
        add({**row, **layer_case(cfg, vpar, dim, num_tokens, mesh, dtype, time_it)})
        if model_cfg is not None:
            mcfg = dataclasses.replace(model_cfg, moe=cfg)
            mpar = dataclasses.replace(vpar, sequence_parallel=sequence_parallel)
            row = {"variant": name, "scope": "model", "placement": variant.placement}
            add({**row, **model_case(mcfg, mpar, mesh, batch, seq_len, time_it)})
    return rows


COLUMNS = (
    "variant",
    "scope",
    "placement",
    "temp MiB",
    "model MiB",
    "args MiB",
    "peak MiB",
    "collectives",
    "coll MiB",
    "step ms",
)
_SHORT = {
    "all-to-all": "a2a",
    "ragged-all-to-all": "ra2a",
    "all-gather": "ag",
    "reduce-scatter": "rs",
    "all-reduce": "ar",
    "collective-permute": "cp",
}


def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:.1f}"


def table(rows: list[dict]) -> str:
    """A compact markdown table of `rows` (collectives as op:count, bytes summed)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        coll = " ".join(f"{_SHORT.get(op, op)}:{s['count']}" for op, s in sorted(r["collectives"].items()))
        cells = [
            r["variant"],
            r["scope"],
            r["placement"],
            _mib(r.get("temp_bytes")),
            _mib(r.get("model_bytes")),
            _mib(r.get("argument_bytes")),
            _mib(r.get("peak_bytes")),
            coll or "-",
            _mib(r["collective_bytes"]),
            "-" if r.get("step_ms") is None else f"{r['step_ms']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def jsonable(obj):
    """Plain JSON types (numpy scalars -> Python)."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
