"""MoE-layer and exchange benchmarks (called by scripts/bench_moe_layer.py).

Shapes: T tokens (all devices), D model, E experts, K top-k, F expert hidden, P peers.

`moe_layer_case` times one MoE layer forward and forward+backward for a config on a
mesh, with routing made uniform or skewed on purpose, and reads from the compiled
program its temporary (activation) memory and collective traffic. `exchange_case`
times the padding-free exchange alone against a dense all_to_all of the same rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xmoe_jax.config import MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer, placement
from xmoe_jax.moe.exchange import Plan, exchange
from xmoe_jax.perf.hlo import collective_stats
from xmoe_jax.perf.timing import time_fn
from xmoe_jax.resolve import resolve_parallel, resolve_transport
from xmoe_jax.sharding import axis_size, exchange_axes


def skew_offsets(num_experts: int, skew: float) -> np.ndarray:
    """Per-expert logit offsets: 0 = uniform; s > 0 gives Zipf-like loads ~ (e+1)^-s."""
    return -skew * np.log(np.arange(1, num_experts + 1, dtype=np.float64))


def make_inputs(cfg: MoEConfig, dim: int, num_tokens: int, skew: float, dtype, seed: int = 0):
    """bf16 params and tokens; feature 0 is constant 1 so router row 0 sets per-expert offsets."""
    kp, kx = jax.random.split(jax.random.key(seed))
    params = init_moe_params(kp, dim, cfg, std=0.02, dtype=dtype)
    params["router"]["kernel"] = (
        params["router"]["kernel"].at[0].set(jnp.asarray(skew_offsets(cfg.num_experts, skew), dtype))
    )
    x_TD = jax.random.normal(kx, (num_tokens, dim), dtype).at[:, 0].set(1)
    return params, x_TD


def useful_flops(cfg: MoEConfig, dim: int, num_tokens: int) -> float:
    """Forward + backward FLOPs of the routed experts for the copies actually routed (3x forward)."""
    mats = 3 if cfg.activation == "swiglu" else 2
    return 3 * 2 * num_tokens * cfg.top_k * mats * dim * cfg.expert_hidden


def place_inputs(params, x_TD, parallel: ParallelConfig, mesh):
    """Router replicated, experts over the expert axes, tokens over the block's token axes."""
    rep = NamedSharding(mesh, PartitionSpec())
    p_sh = {
        "router": jax.tree.map(lambda _: rep, params["router"]),
        "experts": {
            k: NamedSharding(mesh, s) for k, s in placement.expert_specs(params["experts"], parallel).items()
        },
    }
    tokens = NamedSharding(mesh, PartitionSpec(placement.token_axes(parallel)))
    return jax.device_put(params, p_sh), jax.device_put(x_TD, tokens)


def settled_rung(cfg: MoEConfig, parallel: ParallelConfig, params, x_TD, mesh) -> ParallelConfig:
    """`parallel` with the smallest buffer rung (moe/ladder.py) that holds this routing's peak."""
    from xmoe_jax.moe.ladder import rung_for

    worst = dataclasses.replace(parallel, recv_buffer_factor=None)
    _, stats = jax.jit(lambda p, x: moe_layer(p, x, cfg, worst, mesh=mesh))(params, x_TD)
    peak = float(np.asarray(stats.peak_ratio).max()) if stats.peak_ratio is not None else 0.0
    return dataclasses.replace(parallel, recv_buffer_factor=rung_for(peak))


def moe_layer_case(
    cfg: MoEConfig,
    parallel: ParallelConfig,
    dim: int,
    num_tokens: int,
    mesh,
    skew: float,
    dtype=jnp.bfloat16,
    iters: int = 10,
    settle_buffers: bool = False,
) -> dict:
    parallel = resolve_parallel(parallel)  # concrete transport; what `ragged` puts on the wire
    params, x_TD = make_inputs(cfg, dim, num_tokens, skew, dtype)
    params, x_TD = place_inputs(params, x_TD, parallel, mesh)
    r_TD = jax.random.normal(jax.random.key(1), x_TD.shape, dtype)
    if settle_buffers:  # the rung adaptive training would settle on for this routing
        parallel = settled_rung(cfg, parallel, params, x_TD, mesh)

    def objective(params, x_TD):
        y_TD, stats = moe_layer(params, x_TD, cfg, parallel, mesh=mesh)
        return jnp.sum(y_TD.astype(jnp.float32) * r_TD.astype(jnp.float32)) + stats.aux_loss, stats

    fwd = jax.jit(lambda p, x: moe_layer(p, x, cfg, parallel, mesh=mesh))
    train = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    compiled = train.lower(params, x_TD).compile()
    mem = compiled.memory_analysis()
    coll = collective_stats(compiled.as_text())
    _, stats = fwd(params, x_TD)
    t_fwd = time_fn(fwd, params, x_TD, iters=iters)
    t_step = time_fn(compiled, params, x_TD, iters=iters)
    flops = useful_flops(cfg, dim, num_tokens)
    out = {
        "dispatch": parallel.dispatch,
        "transport": parallel.transport,  # settled by resolve_parallel
        "recv_buffer_factor": parallel.recv_buffer_factor,
        "capacity_factor": cfg.capacity_factor,
        "skew": skew,
        "tokens": num_tokens,
        "fwd_ms": 1e3 * t_fwd,
        "fwd_bwd_ms": 1e3 * t_step,
        "tokens_per_s": num_tokens / t_step,
        "useful_tflops_per_device": flops / t_step / mesh.size / 1e12,
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "drop_rate": float(stats.drop_rate),
        "collectives": coll,
    }
    if stats.wire_bytes is not None:
        out["pft_wire_bytes_per_device"] = float(np.mean(np.asarray(stats.wire_bytes)))
        out["routed_bytes_per_device"] = float(np.mean(np.asarray(stats.routed_bytes)))
        out["peak_ratio"] = float(np.asarray(stats.peak_ratio).max())
        out["recv_rows_per_device"] = np.asarray(stats.recv_rows).tolist()
        out["num_overflow"] = int(stats.num_overflow)
    if stats.wire_bytes_node is not None:  # rbd: stage 1 (node axis), per device
        out["rbd_node_wire_bytes_per_device"] = float(np.mean(np.asarray(stats.wire_bytes_node)))
        out["rbd_inter_node_rows"] = int(np.asarray(stats.inter_node_rows).sum())
        out["rbd_pilot_rows"] = int(np.asarray(stats.pilot_rows).sum())
    return out


def exchange_case(
    mesh, rows_per_pair: int, dim: int, transport: str, dtype=jnp.bfloat16, iters: int = 20
) -> dict:
    """One forward exchange with every peer sending `rows_per_pair` rows to every other, vs all_to_all."""
    axes = exchange_axes(mesh)
    peers = axis_size(mesh, axes)
    transport = resolve_transport(transport)  # the record
    rows = peers * rows_per_pair
    sizes_P = jnp.full((peers,), rows_per_pair, jnp.int32)
    offs_P = jnp.arange(peers, dtype=jnp.int32) * rows_per_pair

    def body(x_ND):
        me = jax.lax.axis_index(axes)
        plan = Plan(
            offs_P,
            sizes_P,
            jnp.full((peers,), me * rows_per_pair, jnp.int32),
            sizes_P,
            offs_P,
            jnp.full((peers,), me * rows_per_pair, jnp.int32),
        )
        return exchange(x_ND, plan, rows, rows, axes, transport, rows_per_pair)

    def dense(x_ND):
        return jax.lax.all_to_all(x_ND.reshape(peers, rows_per_pair, dim), axes, 0, 0).reshape(rows, dim)

    spec = PartitionSpec(axes)
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (peers * rows, dim), dtype), NamedSharding(mesh, spec)
    )
    results = {}
    for name, fn in (("exchange", body), ("dense_all_to_all", dense)):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
        t = time_fn(f, x, iters=iters)
        wire = (peers - 1) * rows_per_pair * dim * jnp.dtype(dtype).itemsize  # per device, off-device rows
        results[name] = {"ms": 1e3 * t, "GBps_per_device": wire / t / 1e9}
    return {
        "transport": transport.name,
        "rows_per_pair": rows_per_pair,
        "dim": dim,
        **results,
        "ratio_vs_dense": results["dense_all_to_all"]["ms"] / results["exchange"]["ms"],
    }


def small_shapes(**overrides) -> tuple[MoEConfig, int]:
    """The X-MoE paper's Small expert shapes: D=2048, F=1408, E=64, k=6, GELU experts."""
    cfg = MoEConfig(num_experts=64, top_k=6, expert_hidden=1408, activation="gelu", aux_loss_weight=0.01)
    return dataclasses.replace(cfg, **overrides), 2048
