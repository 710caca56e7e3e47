"""Row-indexed grouped GEMMs vs permute + gmm + ungroup (called by scripts/bench_gather_gmm.py).

Shapes: T tokens, K top-k, R grouped rows (= T*K for ep1, = M for ep4), M received rows, D model,
F expert hidden, E experts (local experts for ep4), P sources.

Steps: 1. build the case's routing (uniform over experts, rows in the layout the layer sees);
2. check each indexed projection against the XLA reference and against the permute path
(relative errors); 3. time (a) the permute path, (b) the indexed gmm, forward and forward+
backward, a dense matmul of the same FLOPs (3x for forward+backward), and torch._grouped_mm on
grouped rows when importable; 4. write JSON after every row and print a table.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.kernels import combine, default_implementation, gmm, permute, token_rows
from xmoe_jax.kernels.backends import reset_warnings
from xmoe_jax.kernels.gmm.xla import gmm_xla
from xmoe_jax.moe.experts import _permute_up
from xmoe_jax.moe.pft import _arrival_index
from xmoe_jax.perf.recorder import Recorder
from xmoe_jax.perf.timing import environment, rel_err, time_fn

CASES = {  # (tokens, top_k, experts, sources, D, F); ep4: tokens*top_k rows arrive from `sources`
    "full": {"ep1": (16384, 6, 64, 1, 2048, 1408), "ep4": (16384, 6, 16, 4, 2048, 1408)},
    "tiny": {"ep1": (48, 3, 8, 1, 64, 48), "ep4": (48, 3, 4, 4, 64, 48)},
}


def _randn(seed, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def ep1_case(tokens, top_k, experts, dim, hidden, seed=0):
    """Tokens routed uniformly to top_k distinct experts: dest [T, K] in expert-major order."""
    rng = np.random.default_rng(seed)
    idx_TK = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    counts = np.bincount(idx_TK.reshape(-1), minlength=experts)
    order = np.argsort(idx_TK.reshape(-1), kind="stable")
    dest_A = np.empty(tokens * top_k, np.int32)
    dest_A[order] = np.arange(tokens * top_k, dtype=np.int32)
    return dict(
        x=_randn(seed, (tokens, dim)),
        dest_TK=jnp.asarray(dest_A.reshape(tokens, top_k)),
        gs=jnp.asarray(counts, jnp.int32),
        rows=tokens * top_k,
    )


def ep4_case(tokens, top_k, local, sources, dim, seed=0):
    """M = T*K received rows in arrival order (source, local expert), about equal per segment."""
    rng = np.random.default_rng(seed)
    rows = tokens * top_k
    cc_PL = rng.multinomial(rows, np.ones(sources * local) / (sources * local)).reshape(sources, local)
    seg_start_PL = np.concatenate([[0], np.cumsum(cc_PL.reshape(-1))[:-1]]).reshape(cc_PL.shape)
    arrival_R = _arrival_index(jnp.asarray(cc_PL, jnp.int32), jnp.asarray(seg_start_PL, jnp.int32), rows)
    grouped_M = np.empty(rows, np.int32)
    grouped_M[np.asarray(arrival_R)] = np.arange(rows, dtype=np.int32)
    return dict(
        x=_randn(seed, (rows, dim)),
        arrival_R=arrival_R,
        grouped_M1=jnp.asarray(grouped_M)[:, None],
        gs=jnp.asarray(cc_PL.sum(0), jnp.int32),
        rows=rows,
    )


def _fwd_bwd(f, num_args: int):
    """jit of f's value and its gradient in every float argument (the first num_args)."""
    return jax.jit(
        jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=tuple(range(num_args)))
    )


def projections(name, case, w_up, w_down, impl):
    """{(proj, variant): (fn of floats, float args, index args)}: the functions to check and time."""
    kw = dict(implementation=impl)
    gs = case["gs"]
    out = {}
    if name == "ep1":
        dest, rows = case["dest_TK"], case["rows"]
        tok_R = token_rows(dest, case["x"].shape[0], rows)
        out[("up", "a_permute")] = (
            lambda x, w: gmm(permute(x, dest, rows, implementation=impl), w, gs, **kw),
            (case["x"], w_up),
        )
        out[("up", "b_gather")] = (lambda x, w: _permute_up(x, dest, rows, (w,), gs)[0], (case["x"], w_up))
        out[("up", "ref")] = (
            lambda x, w: gmm_xla(x, w, gs, out_dtype=x.dtype, lhs_rows_R=tok_R),
            (case["x"], w_up),
        )
    else:
        arr, grp, rows = case["arrival_R"], case["grouped_M1"], case["rows"]
        ones = jnp.ones((rows, 1), jnp.float32)
        h = _randn(7, (rows, w_down.shape[1]))
        out[("up", "a_permute")] = (
            lambda x, w: gmm(permute(x, grp, rows, implementation=impl), w, gs, **kw),
            (case["x"], w_up),
        )
        out[("up", "b_gather")] = (
            lambda x, w: gmm(x, w, gs, lhs_rows_R=arr, distinct_rows=True, zero_unwritten=False, **kw),
            (case["x"], w_up),
        )
        out[("up", "ref")] = (
            lambda x, w: gmm_xla(x, w, gs, out_dtype=x.dtype, lhs_rows_R=arr),
            (case["x"], w_up),
        )
        out[("down", "a_ungroup")] = (
            lambda h, w: combine(gmm(h, w, gs, **kw), grp, ones, implementation=impl),
            (h, w_down),
        )
        out[("down", "b_scatter")] = (
            lambda h, w: gmm(h, w, gs, out_rows_R=arr, num_out_rows=rows, zero_unwritten=False, **kw),
            (h, w_down),
        )
        out[("down", "ref")] = (
            lambda h, w: gmm_xla(h, w, gs, out_dtype=h.dtype, out_rows_R=arr, num_out_rows=rows),
            (h, w_down),
        )
    return out


def _torch_grouped_ms(rows, k_dim, n_dim, gs, iters) -> float | None:
    """torch._grouped_mm on already-grouped bf16 rows (CUDA only), median ms; None if unavailable."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return None
    x = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(gs), n_dim, k_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor(np.cumsum(gs), device="cuda", dtype=torch.int32)
    return torch_median_ms(lambda: torch._grouped_mm(x, w, offs=offs), iters)


def torch_median_ms(fn, iters: int) -> float:
    """Median ms of a CUDA torch call by CUDA events, after 3 warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _time(rec, iters, fn, args, flops, **key):
    try:
        ms = time_fn(fn, *args, warmup=2, iters=iters) * 1e3
        rec.add(**key, ms=ms, tflops=flops / ms / 1e9)
    except Exception as e:  # an OOM or a lowering failure is a result, not a crash
        rec.add(**key, error=f"{type(e).__name__}: {str(e)[:300]}")


def bench_case(rec, name, shape, impl, iters, use_torch):
    tokens, top_k, experts, sources, dim, hidden = shape
    rows = tokens * top_k
    case = (
        ep1_case(tokens, top_k, experts, dim, hidden)
        if name == "ep1"
        else ep4_case(tokens, top_k, experts, sources, dim)
    )
    w_up, w_down = _randn(1, (experts, dim, hidden)), _randn(2, (experts, hidden, dim))
    fns = projections(name, case, w_up, w_down, impl)
    for proj in dict.fromkeys(p for p, _ in fns):
        variants = {v: fns[(proj, v)] for p, v in fns if p == proj}
        ref_fn, ref_args = variants.pop("ref")
        want = jax.jit(ref_fn)(*ref_args)
        k_dim, n_dim = ref_args[1].shape[1], ref_args[1].shape[2]
        flops = 2.0 * rows * k_dim * n_dim
        key = dict(case=name, proj=proj, rows=rows, k=k_dim, n=n_dim, experts=experts, backend=impl)
        results = {}
        for variant, (f, args) in variants.items():
            reset_warnings()
            got = jax.jit(f)(*args)
            results[variant] = got
            rec.add(**key, variant=variant, check="rel_err_vs_xla_reference", rel_err=rel_err(got, want))
        (va, a), (vb, b) = results.items()
        rec.add(**key, variant=f"{vb}_vs_{va}", check="rel_err", rel_err=rel_err(b, a))
        a_ = jax.random.normal(jax.random.key(4), (rows, k_dim), jnp.bfloat16)
        b_ = jax.random.normal(jax.random.key(5), (k_dim, n_dim), jnp.bfloat16)
        _time(
            rec,
            iters,
            jax.jit(lambda a, b: a @ b),
            (a_, b_),
            flops,
            **key,
            variant="dense_same_flops",
            pass_="fwd",
        )
        _time(
            rec,
            iters,
            _fwd_bwd(lambda a, b: a @ b, 2),
            (a_, b_),
            3 * flops,
            **key,
            variant="dense_same_flops",
            pass_="fwd+bwd",
        )
        for variant, (f, args) in variants.items():
            _time(rec, iters, jax.jit(f), args, flops, **key, variant=variant, pass_="fwd")
            _time(rec, iters, _fwd_bwd(f, 2), args, 3 * flops, **key, variant=variant, pass_="fwd+bwd")
        if use_torch:
            ms = _torch_grouped_ms(rows, k_dim, n_dim, np.asarray(case["gs"]), iters)
            if ms is not None:
                rec.add(**key, variant="torch_grouped_mm", pass_="fwd", ms=ms, tflops=flops / ms / 1e9)


def print_table(rows):
    timed = [r for r in rows if "pass_" in r]
    print("\nms (TFLOP/s; for fwd+bwd counting 3x the forward FLOPs)")
    combos = dict.fromkeys((r["case"], r["proj"], r["pass_"]) for r in timed)
    variants = list(dict.fromkeys(r["variant"] for r in timed))
    print(f"{'case/proj/pass':22s}" + "".join(f"{v:>22s}" for v in variants))
    for combo in combos:
        cells = []
        for v in variants:
            r = next(
                (r for r in timed if (r["case"], r["proj"], r["pass_"]) == combo and r["variant"] == v), None
            )
            cells.append(
                "-" if r is None else ("error" if "ms" not in r else f"{r['ms']:.3f} ({r['tflops']:.0f})")
            )
        print(f"{'/'.join(combo):22s}" + "".join(f"{c:>22s}" for c in cells))
    checks = [r for r in rows if "check" in r]
    print(
        "\nrelative errors: "
        + ", ".join(f"{r['case']}/{r['proj']}/{r['variant']} {r['rel_err']:.1e}" for r in checks)
    )


def main(args) -> None:
    t0 = time.perf_counter()
    if args.backend:  # the layer's own functions (_permute_up) pick the default backend
        os.environ["XMOE_KERNELS"] = args.backend
    impl = args.backend or default_implementation("gmm")
    shapes = CASES["tiny" if args.tiny else "full"]
    meta = {
        **environment(),
        "backend": impl,
        "tiny": args.tiny,
        "cases": {c: shapes[c] for c in args.cases.split(",")},
    }
    print(json.dumps(meta), flush=True)
    rec = Recorder(args.out, meta)
    for name in args.cases.split(","):
        bench_case(rec, name, shapes[name], impl, args.iters, not args.no_torch)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s on {meta['device']}, jax {meta['jax']}")
    print_table(rec.rows)
