"""The optimizer step on its own: the train step's guarded AdamW against the same update unguarded,
two other guards, the memory floor, and torch's fused AdamW on the same shapes.

    python scripts/bench_optimizer.py jax --config configs/tiny_small_shape.yaml --out opt_jax.json
    python scripts/bench_optimizer.py torch --config configs/tiny_small_shape.yaml --out opt_torch.json
    python scripts/bench_optimizer.py table opt_jax.json opt_torch.json
    python scripts/bench_optimizer.py jax --config configs/tiny.yaml --iters 3    # CPU dry run

Every parameter of the config's model (float32 master weights, the train state's own layout and
shardings), random gradients and moments one step in (never zeros), global-norm clipping at
optimizer.grad_clip. Rows, time per step (the median of --iters donated steps, best of 3):
  floor        32 bytes per parameter at the device's copy bandwidth measured in the same run: read
               the gradient for its norm, then read param, gradient and both moments and write param
               and moments once (float32; 2 bytes less per moment with optimizer.state_dtype=bfloat16)
  unguarded    the update applied with no finiteness check: what XLA makes of AdamW alone
  step         `optimizer.guarded_update`, the train step's guard: the gradient norm and a bound on
               every update (`optimizer.update_bound`), scalars known before the update pass
  update_check the guard before it: every update checked for finiteness, then kept
  state_check  a guard on the new state (params and moments) instead, as XLA plans it
  barrier      state_check with the check recomputed behind an optimization barrier (a read-only pass)
  torch        torch.optim.AdamW(fused=True) after clip_grad_norm_(foreach=True), no check (torch mode)
Correctness first: every row gives the same params bit for bit, and each is compared with a float64
NumPy AdamW on one leaf (relative error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

FLOOR_BYTES = (
    32  # per float32 parameter: the norm's read (4), then p, g, m, v read (16) and p, m, v written (12)
)


def _config(args):
    from xmoe_jax.config import load_config

    return load_config(args.config, args.overrides)


def _shapes(cfg) -> list[tuple[int, ...]]:
    import jax

    from xmoe_jax.model import functional as fmodel

    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    return [tuple(x.shape) for x in jax.tree.leaves(spec.params_shape)]


def all_finite(tree):
    """Every element of every leaf is finite (no norm: a large finite value must not overflow it):
    the check the guards before `optimizer.update_bound` ran on updates or state."""
    import jax
    import jax.numpy as jnp

    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]).all()


def _time(run, state, iters: int, *args) -> tuple[float, object]:
    """Median seconds per call of `state = run(state, *args)`, best of 3 rounds; the last state."""
    import jax

    best = float("inf")
    for _ in range(3):
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            state = run(state, *args)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best, state


def bench_jax(args) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from xmoe_jax.perf.timing import environment
    from xmoe_jax.sharding import make_mesh
    from xmoe_jax.train import optimizer as topt
    from xmoe_jax.train import state as tstate

    cfg = _config(args)
    mesh = make_mesh(cfg.mesh)
    layout = tstate.build(cfg, mesh)
    opt = layout.optimizer
    sh = layout.shardings

    def random_like(key, s, scale):
        return jax.random.normal(key, s.shape, s.dtype) * scale

    shapes = layout.spec.params_shape
    keys = jax.tree.unflatten(
        jax.tree.structure(shapes), jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes)))
    )
    params = jax.jit(
        lambda k: jax.tree.map(lambda kk, s: random_like(kk, s, 0.02), k, shapes), out_shardings=sh.params
    )(keys)
    grads = jax.jit(
        lambda k: jax.tree.map(lambda kk, s: random_like(jax.random.fold_in(kk, 1), s, 1e-3), k, shapes),
        out_shardings=sh.params,
    )(keys)
    moments = jax.jit(lambda p, g: opt.update(g, opt.init(p), p)[1], out_shardings=sh.opt)(params, grads)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    allowed = jnp.ones((), bool)

    def unguarded(state, grads):
        p, o = state
        u, o = opt.update(grads, o, p)
        return optax.apply_updates(p, u), o

    bound = topt.update_bound(cfg.optimizer, cfg.train.steps)

    def step(state, grads):  # what the train step runs
        p, o, *_ = topt.guarded_update(opt, *state, grads, allowed, bound)
        return p, o

    def update_check(state, grads):  # the step's guard before update_bound: every update checked
        p, o = state
        norm = optax.tree.norm(grads)
        u, o_new = opt.update(grads, o, p)
        ok = allowed & jnp.isfinite(norm) & all_finite(u)
        keep = lambda n, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), n, old)  # noqa: E731
        return keep(optax.apply_updates(p, u), p), keep(o_new, o)

    def state_check(state, grads):  # the guard on the new state, without the barrier: XLA's own plan
        p, o = state
        norm = optax.tree.norm(grads)
        u, o_new = opt.update(grads, o, p)
        p_new = optax.apply_updates(p, u)
        ok = allowed & jnp.isfinite(norm) & all_finite((p_new, o_new))
        keep = lambda n, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), n, old)  # noqa: E731
        return keep(p_new, p), keep(o_new, o)

    def barrier(state, grads):  # state_check recomputed behind an optimization barrier: one read-only pass
        p, o = state
        norm = optax.tree.norm(grads)
        g2, o2, p2 = jax.lax.optimization_barrier((grads, o, p))
        u2, o2_new = opt.update(g2, o2, p2)
        ok = allowed & jnp.isfinite(norm) & all_finite((optax.apply_updates(p2, u2), o2_new))
        u, o_new = opt.update(grads, o, p)
        keep = lambda n, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), n, old)  # noqa: E731
        return keep(optax.apply_updates(p, u), p), keep(o_new, o)

    variants = {
        "unguarded": unguarded,
        "step": step,
        "update_check": update_check,
        "state_check": state_check,
        "barrier": barrier,
    }
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    copy = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    buf = jnp.ones((args.copy_mib * 2**18,), jnp.float32)
    copy_s, _ = _time(copy, buf, args.iters)
    bandwidth = 2 * buf.nbytes / copy_s
    del buf
    itemsize = jnp.dtype(cfg.optimizer.state_dtype).itemsize
    floor_bytes = (FLOOR_BYTES - 2 * 2 * (4 - itemsize)) * num_params
    rows = {"floor": {"ms": floor_bytes / bandwidth * 1e3, "bytes": floor_bytes}}
    first_leaf = lambda t: np.asarray(jax.tree.leaves(t)[0], np.float64)  # noqa: E731
    results = {}
    for name, fn in variants.items():
        run = jax.jit(fn, donate_argnums=0, out_shardings=(sh.params, sh.opt))
        state = jax.tree.map(jnp.copy, (params, moments))
        results[name] = np.asarray(jax.tree.leaves(run(jax.tree.map(jnp.copy, state), grads)[0])[0])
        seconds, state = _time(run, state, args.iters, grads)
        del state
        cost = run.lower((params, moments), grads).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows[name] = {"ms": seconds * 1e3, "xla_bytes_accessed": float((cost or {}).get("bytes accessed", 0))}
        print(
            f"{name}: {seconds * 1e3:.3f} ms, XLA's bytes accessed {rows[name]['xla_bytes_accessed']:.3g}",
            flush=True,
        )
    # correctness: one step from the same state, against float64 AdamW on the first leaf
    decayed = bool(jax.tree.leaves(topt.decay_mask(params))[0])
    ref = _adamw_reference(cfg.optimizer, first_leaf(params), first_leaf(grads), moments, grads, decayed)
    check = {name: float(np.abs(out - ref).max() / np.abs(ref).max()) for name, out in results.items()}
    names = list(results)
    bit_equal = {n: bool(np.array_equal(results[names[0]], results[n])) for n in names[1:]}
    same = all(bit_equal.values())
    for name, row in rows.items():
        row["x_floor"] = row["ms"] / rows["floor"]["ms"]
        if name in check:
            row["rel_err_vs_float64"] = check[name]
    return {
        **environment(),
        "mode": "jax",
        "config": args.config,
        "overrides": args.overrides,
        "num_params": num_params,
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "variants_equal_bit_for_bit": same,
        # each variant against the first (unguarded): XLA may fuse a variant's arithmetic differently (jax 0.12.1
        # on CPU: `barrier` 1 ulp off in 20 of 2048 values), the train step's guard (`step`) must not differ
        "bit_equal_to_first": bit_equal,
        "rows": rows,
    }


def _adamw_reference(ocfg, p, g_leaf, moments, grads, decayed: bool) -> np.ndarray:
    """Step 2 of AdamW on one leaf in float64 (step 1 made `moments`), clipped by the global norm."""
    import jax

    from xmoe_jax.train.optimizer import lr_on_host

    norm = np.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(grads)))
    g = g_leaf * (min(1.0, ocfg.grad_clip / norm) if ocfg.grad_clip else 1.0)
    adam = next(s for s in jax.tree.leaves(moments, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    m0 = np.asarray(jax.tree.leaves(adam.mu)[0], np.float64)
    v0 = np.asarray(jax.tree.leaves(adam.nu)[0], np.float64)
    t = int(adam.count) + 1
    m = ocfg.b1 * m0 + (1 - ocfg.b1) * g
    v = ocfg.b2 * v0 + (1 - ocfg.b2) * g * g
    u = (m / (1 - ocfg.b1**t)) / (np.sqrt(v / (1 - ocfg.b2**t)) + ocfg.eps)
    decay = ocfg.weight_decay if decayed else 0.0
    lr = lr_on_host(ocfg, 10**9)(t - 1)
    return p - lr * (u + decay * p)


def bench_torch(args) -> dict:
    import torch

    cfg = _config(args)
    shapes = _shapes(cfg)
    ocfg = cfg.optimizer
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=dev, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
    opt = torch.optim.AdamW(
        params, lr=ocfg.lr, betas=(ocfg.b1, ocfg.b2), eps=ocfg.eps, weight_decay=ocfg.weight_decay, fused=True
    )

    def step():
        if ocfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, ocfg.grad_clip, foreach=True)
        opt.step()

    step()
    best = float("inf")
    for _ in range(3):
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return {
        "mode": "torch",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "num_params": sum(p.numel() for p in params),
        "rows": {"torch": {"ms": best * 1e3}},
    }


def table(paths: list[str]) -> str:
    rows, floor, head = {}, None, []
    for path in paths:
        rec = json.load(open(path))
        rows.update(rec["rows"])
        floor = rec["rows"].get("floor", {}).get("ms", floor)
        head.append(
            f"{rec['mode']}: {rec.get('device')} {rec.get('jax', rec.get('torch'))}, {rec['num_params'] / 1e9:.2f}B params"
            + (
                f", copy {rec['copy_bandwidth_gbs']:.0f} GB/s, bit-equal {rec['variants_equal_bit_for_bit']}"
                if "copy_bandwidth_gbs" in rec
                else ""
            )
        )
    lines = [
        *head,
        "",
        "| row | ms | x floor | x step | XLA's bytes accessed per param | rel. error vs float64 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    num_params = max(json.load(open(path))["num_params"] for path in paths)
    guarded = rows.get("step", {}).get("ms")
    for name, row in rows.items():
        x_floor = f"{row['ms'] / floor:.2f}" if floor else "-"
        x_guard = f"{row['ms'] / guarded:.2f}" if guarded else "-"
        err = f"{row['rel_err_vs_float64']:.1e}" if "rel_err_vs_float64" in row else "-"
        per = f"{row['xla_bytes_accessed'] / num_params:.1f}" if row.get("xla_bytes_accessed") else "-"
        lines.append(f"| {name} | {row['ms']:.3f} | {x_floor} | {x_guard} | {per} | {err} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["jax", "torch", "table"])
    p.add_argument("paths", nargs="*", help="table: the JSON files")
    p.add_argument("--config", default="configs/tiny_small_shape.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--copy-mib", type=int, default=4096, help="the bandwidth probe's array (MiB)")
    p.add_argument(
        "--variants",
        default="",
        help="jax: a comma list of unguarded,step,update_check,state_check,barrier (default all)",
    )
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.mode == "table":
        print(table(args.paths))
        return 0
    rec = bench_jax(args) if args.mode == "jax" else bench_torch(args)
    rec["command"] = " ".join(sys.argv)
    print(json.dumps(rec, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
