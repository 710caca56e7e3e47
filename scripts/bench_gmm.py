"""Grouped-GEMM and permute/combine throughput per backend, next to same-run rooflines.

    python scripts/bench_gmm.py --out bench_gmm.json                 # everything (~2 min on one H100)
    python scripts/bench_gmm.py --configs small --backends pallas,mgpu --out b.json
    python scripts/bench_gmm.py --sweep --out sweep.json              # tile / launch sweep for pallas, triton

Expert shapes (X-MoE paper, bf16): Small D=2048 F=1408 E=64 k=6, 32768 tokens -> R=196608 rows;
Large D=7168 F=2048 E_local=32 k=8, 16384 tokens -> R=131072 rows (about 10 GB of operands).
For each backend (pallas, triton, mgpu, xla = jax.lax.ragged_dot) and each projection (up:
[R,D]x[E,D,F], down: [R,F]x[E,F,D]): forward (gmm), dgrad (gmm with rhs transposed) and wgrad
(tgmm) TFLOP/s, with uniform and Zipf(1.0)-skewed group sizes. Baselines from the same run:
a dense bf16 matmul of the same shape and FLOPs, a padded batched einsum at capacity factor
1.25 (useful FLOPs only), and an 8192^3 matmul. Permute / combine (Small: T=32768, k=6,
D=2048) report GB/s (bytes read + written) next to a device copy of the same buffer.

Each measurement is isolated (try/except, e.g. XLA's dense ragged_dot gradient can run out of
memory); results go to --out after every measurement; a compact table prints last.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.kernels import IMPLEMENTATIONS, combine, defaults, gmm, permute, tgmm
from xmoe_jax.kernels.backends import reset_warnings
from xmoe_jax.kernels.platform import platform
from xmoe_jax.perf.recorder import Recorder
from xmoe_jax.perf.timing import dense_matmul_tflops, environment, time_fn

CONFIGS = {
    "small": dict(dim=2048, hidden=1408, experts=64, top_k=6, tokens=32768),
    "large": dict(dim=7168, hidden=2048, experts=32, top_k=8, tokens=16384),
}
CAPACITY_FACTOR = 1.25
ZIPF_S = 1.0


def group_sizes(dist: str, rows: int, experts: int, seed: int = 0) -> jax.Array:
    if dist == "uniform":
        p = np.ones(experts)
    else:  # Zipf over a random expert order: the busiest expert gets ~1/H_E of the rows
        p = np.random.default_rng(seed).permutation(1.0 / np.arange(1, experts + 1) ** ZIPF_S)
    sizes = np.floor(p / p.sum() * rows).astype(np.int64)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


def randn(seed, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def measure(rec: Recorder, iters: int, fn, args, flops=None, nbytes=None, **key):
    try:
        seconds = time_fn(fn, *args, warmup=1 if iters < 5 else 2, iters=iters)
        row = dict(key, ms=seconds * 1e3)
        if flops:
            row["tflops"] = flops / seconds / 1e12
        if nbytes:
            row["gbps"] = nbytes / seconds / 1e9
        rec.add(**row)
        return seconds
    except Exception as e:  # an OOM or a lowering failure is a result, not a crash
        rec.add(**key, error=f"{type(e).__name__}: {str(e)[:300]}")
        return None


def gmm_pass_fns(backend: str):
    return {
        "fwd": jax.jit(lambda x, w, gs: gmm(x, w, gs, implementation=backend)),
        "dgrad": jax.jit(lambda g, w, gs: gmm(g, w, gs, implementation=backend, transpose_rhs=True)),
        "wgrad": jax.jit(lambda x, g, gs: tgmm(x, g, gs, implementation=backend)),
    }


def bench_gmm_config(rec, name, cfg, backends, dists, iters):
    rows = cfg["tokens"] * cfg["top_k"]
    experts = cfg["experts"]
    cap = int(np.ceil(CAPACITY_FACTOR * rows / experts))
    for proj, (k, n) in {"up": (cfg["dim"], cfg["hidden"]), "down": (cfg["hidden"], cfg["dim"])}.items():
        flops = 2.0 * rows * k * n
        x, w, g = randn(1, (rows, k)), randn(2, (experts, k, n)), randn(3, (rows, n))
        key = dict(config=name, proj=proj, rows=rows, k=k, n=n, experts=experts)
        # baselines: dense matmul of the same shape, padded batched einsum at cf 1.25
        a, b = randn(4, (rows, k)), randn(5, (k, n))
        measure(
            rec,
            iters,
            jax.jit(lambda a, b: a @ b),
            (a, b),
            flops,
            **key,
            kind="dense_same_flops",
            dist="-",
            pass_="fwd",
        )
        xe, ge = randn(6, (experts, cap, k)), randn(7, (experts, cap, n))
        padded = {
            "fwd": (jax.jit(lambda x, w: jnp.einsum("eck,ekn->ecn", x, w)), (xe, w)),
            "dgrad": (jax.jit(lambda g, w: jnp.einsum("ecn,ekn->eck", g, w)), (ge, w)),
            "wgrad": (jax.jit(lambda x, g: jnp.einsum("eck,ecn->ekn", x, g)), (xe, ge)),
        }
        for pass_, (fn, args) in padded.items():
            measure(rec, iters, fn, args, flops, **key, kind="padded_cf1.25", dist="-", pass_=pass_)
        del a, b, xe, ge
        for backend in backends:
            fns = gmm_pass_fns(backend)
            n_iter = 3 if backend == "xla" else iters  # XLA's ragged_dot computes densely: slow
            for dist in dists:
                gs = group_sizes(dist, rows, experts)
                # dgrad = g @ w[e].T: transpose_rhs reads w [E, K, N] as [E, out, contraction]
                operands = {"fwd": (x, w, gs), "dgrad": (g, w, gs), "wgrad": (x, g, gs)}
                for pass_, fn in fns.items():
                    reset_warnings()
                    measure(
                        rec, n_iter, fn, operands[pass_], flops, **key, kind=backend, dist=dist, pass_=pass_
                    )


def permute_ops(cfg, backend):
    """(jitted fn, args, fewest bytes moved) for permute, combine and combine's backward."""
    tokens, top_k, dim = cfg["tokens"], cfg["top_k"], cfg["dim"]
    copies = tokens * top_k
    x, y = randn(10, (tokens, dim)), randn(11, (copies, dim))
    w = jax.random.uniform(jax.random.key(12), (tokens, top_k))
    dest = jax.random.permutation(jax.random.key(13), copies).astype(jnp.int32)
    row = dim * 2  # bytes per bf16 row; each input row read once, each output row written once
    grad = jax.grad(
        lambda y, w, d: jnp.sum(combine(y, d, w, implementation=backend).astype(jnp.float32)), (0, 1)
    )
    return {
        "permute": (
            jax.jit(lambda x, d: permute(x, d, copies, implementation=backend)),
            (x, dest),
            (tokens + copies) * row,
        ),
        "combine": (
            jax.jit(lambda y, d, w: combine(y, d, w, implementation=backend)),
            (y, dest, w),
            (copies + tokens) * row,
        ),
        # dy = permute(dout): read T rows, write A rows; dw = gather-dot: read T + A rows
        "combine_bwd": (jax.jit(grad), (y, w, dest), (2 * tokens + 2 * copies) * row),
    }


def bench_permute(rec, cfg, backends, iters):
    copies, dim = cfg["tokens"] * cfg["top_k"], cfg["dim"]
    key = dict(config="small", tokens=cfg["tokens"], top_k=cfg["top_k"], dim=dim)
    y = randn(11, (copies, dim))
    copy_fn = jax.jit(lambda y: y + jnp.asarray(1, y.dtype))
    measure(rec, iters, copy_fn, (y,), nbytes=2 * copies * dim * 2, **key, kind="device_copy", op="copy")
    for backend in [b for b in backends if b in ("xla", "pallas")]:
        for op, (fn, args, nbytes) in permute_ops(cfg, backend).items():
            measure(rec, iters, fn, args, nbytes=nbytes, **key, kind=backend, op=op)


GMM_TILES = [(128, 64, 128), (128, 64, 256), (128, 128, 128), (256, 64, 128), (64, 64, 256), (128, 32, 256)]
TGMM_TILES = [(128, 64, 128), (64, 128, 128), (128, 128, 128), (32, 128, 128), (64, 128, 256), (64, 256, 128)]
LAUNCHES = [(4, 3), (8, 3), (8, 4), (4, 4)]
PERMUTE_BLOCKS = [(bt, bd, nw) for bt in (8, 16, 32) for bd in (512, 1024, 2048) for nw in (4, 8)]


def sweep(rec, backends, iters):
    """Tiles x launch parameters on the Small up-projection (uniform groups), then permute blocks."""
    from xmoe_jax.kernels.permute import pallas as permute_pallas

    cfg = CONFIGS["small"]
    rows, experts, k, n = cfg["tokens"] * cfg["top_k"], cfg["experts"], cfg["dim"], cfg["hidden"]
    x, w, g = randn(1, (rows, k)), randn(2, (experts, k, n)), randn(3, (rows, n))
    gs = group_sizes("uniform", rows, experts)
    flops = 2.0 * rows * k * n
    plat = platform()
    for backend in [b for b in backends if b in ("pallas", "triton")]:
        passes = [("fwd", "gmm", GMM_TILES, (x, w, gs)), ("dgrad", "gmm", GMM_TILES, (g, w, gs))]
        passes.append(("wgrad", "tgmm", TGMM_TILES, (x, g, gs)))
        for pass_, op, tiles, args in passes:
            for tile in tiles:
                for launch in LAUNCHES:
                    defaults.LAUNCH[(backend, plat)] = {"gmm": launch, "tgmm": launch}
                    if op == "tgmm":
                        fn = jax.jit(
                            lambda a, b, gs, t=tile, i=backend: tgmm(a, b, gs, implementation=i, tile=t)
                        )
                    else:
                        tr = pass_ == "dgrad"
                        fn = jax.jit(
                            lambda a, b, gs, t=tile, i=backend, tr=tr: gmm(
                                a, b, gs, implementation=i, tile=t, transpose_rhs=tr
                            )
                        )
                    measure(
                        rec,
                        iters,
                        fn,
                        args,
                        flops,
                        kind=backend,
                        tile=list(tile),
                        num_warps=launch[0],
                        num_stages=launch[1],
                        pass_=pass_,
                    )
    if "pallas" in backends:
        for bt, bd, nw in PERMUTE_BLOCKS:
            permute_pallas.BLOCKS["scatter_rows"] = dict(
                block_tokens=bt, block_rows=bt, block_d=bd, num_warps=nw
            )
            permute_pallas.BLOCKS["combine_rows"] = dict(block_tokens=bt, block_d=bd, num_warps=nw)
            permute_pallas.BLOCKS["gather_dot"] = dict(block_tokens=bt, block_d=min(bd, 512), num_warps=nw)
            for op, (fn, args, nbytes) in permute_ops(cfg, "pallas").items():
                measure(rec, iters, fn, args, nbytes=nbytes, kind="pallas", op=op, blocks=[bt, bd, nw])


def print_tables(rows, dense_8192):
    print(f"\ndense bf16 matmul 8192^3: {dense_8192:.0f} TFLOP/s")
    gmm_rows = [r for r in rows if "proj" in r]
    if gmm_rows:
        kinds = list(dict.fromkeys(r["kind"] for r in gmm_rows if r["kind"] not in ("dense_same_flops",)))
        print("TFLOP/s (% of the dense matmul of the same shape)".ljust(40))
        print(f"{'config/proj/pass/dist':32s}" + "".join(f"{k:>20s}" for k in ["dense", *kinds]))
        combos = dict.fromkeys(
            (r["config"], r["proj"], r["pass_"], r["dist"]) for r in gmm_rows if r["dist"] != "-"
        )
        for cfg, proj, pass_, dist in combos:
            dense = next(
                (
                    r.get("tflops")
                    for r in gmm_rows
                    if r["config"] == cfg and r["proj"] == proj and r["kind"] == "dense_same_flops"
                ),
                None,
            )
            cells = [f"{dense:20.0f}" if dense else f"{'-':>20s}"]
            for kind in kinds:
                r = next(
                    (
                        r
                        for r in gmm_rows
                        if (r["config"], r["proj"], r["pass_"], r["kind"]) == (cfg, proj, pass_, kind)
                        and r["dist"] in (dist, "-")
                    ),
                    None,
                )
                if r is None:
                    cells.append(f"{'-':>20s}")
                elif "tflops" not in r:
                    cells.append(f"{'error':>20s}")
                else:
                    pct = f" ({100 * r['tflops'] / dense:.0f}%)" if dense else ""
                    cells.append(f"{r['tflops']:.0f}{pct}".rjust(20))
            print(f"{cfg + '/' + proj + '/' + pass_ + '/' + dist:32s}" + "".join(cells))
    perm_rows = [r for r in rows if "op" in r and "blocks" not in r]
    if perm_rows:
        copy = next((r.get("gbps") for r in perm_rows if r["op"] == "copy"), None)
        print(f"\npermute/combine GB/s (read+write; device copy {copy or 0:.0f} GB/s)")
        for r in perm_rows:
            if r["op"] == "copy":
                continue
            val = (
                f"{r['gbps']:.0f} ({100 * r['gbps'] / copy:.0f}% of copy)"
                if "gbps" in r and copy
                else r.get("error", "-")[:60]
            )
            print(f"  {r['kind']:8s} {r['op']:12s} {val}")
    sweep_rows = [r for r in rows if "tile" in r]
    if sweep_rows:
        print("\nsweep (Small up, uniform): best per backend and pass")
        for kind in dict.fromkeys(r["kind"] for r in sweep_rows):
            for pass_ in ("fwd", "dgrad", "wgrad"):
                ok = [r for r in sweep_rows if r["kind"] == kind and r["pass_"] == pass_ and "tflops" in r]
                if ok:
                    best = max(ok, key=lambda r: r["tflops"])
                    print(
                        f"  {kind:7s} {pass_:6s} {best['tflops']:.0f} TFLOP/s tile={best['tile']} warps={best['num_warps']} stages={best['num_stages']}"
                    )
    block_rows = [r for r in rows if "blocks" in r and "gbps" in r]
    for op in dict.fromkeys(r["op"] for r in block_rows):
        best = max((r for r in block_rows if r["op"] == op), key=lambda r: r["gbps"])
        print(f"  pallas  {op:12s} {best['gbps']:.0f} GB/s with blocks (tokens, d, warps) = {best['blocks']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="small,large")
    p.add_argument("--backends", default="pallas,triton,mgpu,xla")
    p.add_argument("--dists", default="uniform,zipf")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-permute", action="store_true")
    p.add_argument("--sweep", action="store_true", help="only the tile/launch sweep for pallas and triton")
    p.add_argument(
        "--sweep-tiles", default=None, help='override the GEMM sweep tiles: "128,64,256;256,64,128"'
    )
    p.add_argument("--sweep-launch", default=None, help='override the launch sweep: "8,4;8,3" (warps,stages)')
    p.add_argument("--sweep-no-permute", action="store_true")
    p.add_argument(
        "--out", default=None, help="write the results as JSON here (updated after each measurement)"
    )
    args = p.parse_args()
    backends = args.backends.split(",")
    t0 = time.perf_counter()
    dense_8192 = dense_matmul_tflops()
    meta = {
        **environment(),
        "command": "python scripts/bench_gmm.py "
        + " ".join(f"--{k}={v}" for k, v in vars(args).items() if v not in (None, False)),
        "dense_matmul_8192_tflops": dense_8192,
        "backends_unavailable": {b: IMPLEMENTATIONS[b].unavailable_reason() for b in backends},
        "default_tiles": {f"{k[0]}/{k[1]}": v for k, v in defaults.DEFAULT_TILES.items()},
        "launch": {f"{k[0]}/{k[1]}": v for k, v in defaults.LAUNCH.items()},
        "capacity_factor": CAPACITY_FACTOR,
        "zipf_s": ZIPF_S,
    }
    print(json.dumps(meta), flush=True)
    rec = Recorder(args.out, meta)
    if args.sweep:
        global GMM_TILES, TGMM_TILES, LAUNCHES, PERMUTE_BLOCKS
        if args.sweep_tiles:
            GMM_TILES = TGMM_TILES = [
                tuple(int(v) for v in t.split(",")) for t in args.sweep_tiles.split(";")
            ]
        if args.sweep_launch:
            LAUNCHES = [tuple(int(v) for v in t.split(",")) for t in args.sweep_launch.split(";")]
        if args.sweep_no_permute:
            PERMUTE_BLOCKS = []
        sweep(rec, backends, args.iters)
    else:
        for name in args.configs.split(","):
            bench_gmm_config(rec, name, CONFIGS[name], backends, args.dists.split(","), args.iters)
        if not args.no_permute:
            bench_permute(rec, CONFIGS["small"], backends, args.iters)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s on {meta['device']}, jax {meta['jax']}")
    print_tables(rec.rows, dense_8192)


if __name__ == "__main__":
    main()
