"""Correctness of every kernel backend on the GPU this runs on (the GPU half of tests/test_kernels.py).

    python scripts/check_kernels_gpu.py --out kernels_check.json
    python scripts/check_kernels_gpu.py --backends pallas,mgpu --out check.json

For each backend (pallas = Pallas Triton lowering, triton = jax-triton, mgpu = Mosaic GPU,
xla) runs gmm / transposed gmm (dgrad) / tgmm (wgrad) / gradients through gmm's custom VJP on
uneven groups (empty groups, sizes that are not tile multiples, sum(group_sizes) < R, K and N
not tile multiples) and on tile-aligned MoE-like shapes, plus permute/combine and their
gradients, against float64 NumPy references. Each check is isolated (try/except); a backend
that cannot take a shape falls back and the table says so ("fb->pallas"). Prints a table of
backend x check (pass/FAIL/error with the relative error) last and writes JSON to --out.
Takes about a minute on one H100.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.benchmarking import environment
from xmoe_jax.kernels import backends as dispatch
from xmoe_jax.kernels import combine, gmm, permute, tgmm

TOL = {"float32": 1e-3, "bfloat16": 1e-2}  # f32: IEEE in our kernels, XLA may use TF32


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rel_err(got, want) -> float:
    got = f64(got)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def groups(sizes):
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]


def gmm_ref(x, w_EKN, sizes):
    out = np.zeros((x.shape[0], w_EKN.shape[2]))
    for e, rows in enumerate(groups(sizes)):
        out[rows] = x[rows] @ w_EKN[e]
    return out


def tgmm_ref(x, g, sizes):
    return np.stack([x[rows].T @ g[rows] for rows in groups(sizes)])


def randn(seed, shape, dtype):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def skewed_sizes(rng, num_rows, num_groups, fill=1.0, empty=3):
    p = 1.0 / np.arange(1, num_groups + 1) ** 1.1
    p[rng.choice(num_groups, empty, replace=False)] = 0
    sizes = np.floor(rng.permutation(p) / p.sum() * num_rows * fill).astype(np.int64)
    return sizes


# ------------------------------------------------------------------ checks: each returns rel err


def check_gmm(impl, dtype, num_rows, k, n, e, fill, seed, transpose=False):
    rng = np.random.default_rng(seed)
    sizes = skewed_sizes(rng, num_rows, e, fill)
    x = randn(seed, (num_rows, k), dtype)
    w = randn(seed + 1, (e, n, k) if transpose else (e, k, n), dtype)
    out = jax.jit(lambda x, w, gs: gmm(x, w, gs, implementation=impl, transpose_rhs=transpose))(
        x, w, jnp.asarray(sizes, jnp.int32)
    )
    w_EKN = np.swapaxes(f64(w), 1, 2) if transpose else f64(w)
    want = gmm_ref(f64(x), w_EKN, sizes)
    if np.any(f64(out)[sizes.sum() :]):
        return float("inf")  # rows past the groups must be zero
    return rel_err(out, want)


def check_tgmm(impl, dtype, num_rows, k, n, e, fill, seed):
    rng = np.random.default_rng(seed)
    sizes = skewed_sizes(rng, num_rows, e, fill)
    x, g = randn(seed, (num_rows, k), dtype), randn(seed + 1, (num_rows, n), dtype)
    out = jax.jit(lambda x, g, gs: tgmm(x, g, gs, implementation=impl))(x, g, jnp.asarray(sizes, jnp.int32))
    return rel_err(out, tgmm_ref(f64(x), f64(g), sizes))


def check_gmm_grads(impl, dtype, num_rows, k, n, e, fill, seed):
    rng = np.random.default_rng(seed)
    sizes = skewed_sizes(rng, num_rows, e, fill)
    x, w, cot = (
        randn(seed, (num_rows, k), dtype),
        randn(seed + 1, (e, k, n), dtype),
        randn(seed + 2, (num_rows, n), dtype),
    )
    gs = jnp.asarray(sizes, jnp.int32)
    dx, dw = jax.jit(
        jax.grad(lambda x, w: jnp.sum((gmm(x, w, gs, implementation=impl) * cot).astype(jnp.float32)), (0, 1))
    )(x, w)
    want_dx = gmm_ref(f64(cot), np.swapaxes(f64(w), 1, 2), sizes)
    want_dw = tgmm_ref(f64(x), f64(cot), sizes)
    return max(rel_err(dx, want_dx), rel_err(dw, want_dw))


def check_permute_combine(impl, dtype, num_tokens, top_k, dim, seed):
    rng = np.random.default_rng(seed)
    num_copies = num_tokens * top_k
    num_rows = int(num_copies * 0.9)  # some copies dropped
    dest = rng.permutation(num_copies).astype(np.int32)
    dest = np.where(dest < num_rows, dest, -1).astype(np.int32)
    x, w = (
        randn(seed, (num_tokens, dim), dtype),
        jax.random.uniform(jax.random.key(seed), (num_tokens, top_k)),
    )
    y, cot_R, cot_T = (
        randn(seed + 1, (num_rows, dim), dtype),
        randn(seed + 2, (num_rows, dim), dtype),
        randn(seed + 3, (num_tokens, dim), dtype),
    )
    xs, ws, ys = f64(x), f64(w).reshape(-1), f64(y)
    ok = dest >= 0
    tok = np.arange(num_copies) // top_k
    want_p = np.zeros((num_rows, dim))
    want_p[dest[ok]] = xs[tok[ok]] * ws[ok, None]
    want_c = np.zeros((num_tokens, dim))
    np.add.at(want_c, tok[ok], ys[dest[ok]] * ws[ok, None])
    got_p = jax.jit(lambda x, d, w: permute(x, d, num_rows, w, implementation=impl))(x, dest, w)
    got_c = jax.jit(lambda y, d, w: combine(y, d, w, implementation=impl))(y, dest, w)
    # gradients: permute's are combine-like, combine's are permute-like
    dx, dwp = jax.jit(
        jax.grad(
            lambda x, w: jnp.sum(
                (permute(x, dest, num_rows, w, implementation=impl) * cot_R).astype(jnp.float32)
            ),
            (0, 1),
        )
    )(x, w)
    dy, dwc = jax.jit(
        jax.grad(
            lambda y, w: jnp.sum((combine(y, dest, w, implementation=impl) * cot_T).astype(jnp.float32)),
            (0, 1),
        )
    )(y, w)
    cr, ct = f64(cot_R), f64(cot_T)
    want_dx = np.zeros((num_tokens, dim))
    np.add.at(want_dx, tok[ok], cr[dest[ok]] * ws[ok, None])
    want_dwp = np.zeros(num_copies)
    want_dwp[ok] = np.sum(cr[dest[ok]] * xs[tok[ok]], axis=1)
    want_dy = np.zeros((num_rows, dim))
    want_dy[dest[ok]] = ct[tok[ok]] * ws[ok, None]
    want_dwc = np.zeros(num_copies)
    want_dwc[ok] = np.sum(ct[tok[ok]] * ys[dest[ok]], axis=1)
    errs = [
        rel_err(got_p, want_p),
        rel_err(got_c, want_c),
        rel_err(dx, want_dx),
        rel_err(np.asarray(dwp).reshape(-1), want_dwp),
        rel_err(dy, want_dy),
        rel_err(np.asarray(dwc).reshape(-1), want_dwc),
    ]
    return max(errs)


UNEVEN = dict(num_rows=1000, k=200, n=136, e=8, fill=0.97)  # K, N, sizes not tile multiples; sum < R
ALIGNED = dict(num_rows=8192, k=512, n=384, e=16, fill=1.0)  # Mosaic-friendly
MOE = dict(num_rows=16384, k=2048, n=1408, e=64, fill=0.99)  # X-MoE Small up-projection, fewer rows

CHECKS = {
    "gmm_f32_uneven": lambda impl: check_gmm(impl, jnp.float32, seed=1, **UNEVEN),
    "gmm_bf16_uneven": lambda impl: check_gmm(impl, jnp.bfloat16, seed=2, **UNEVEN),
    "gmm_bf16_aligned": lambda impl: check_gmm(impl, jnp.bfloat16, seed=3, **ALIGNED),
    "gmm_bf16_moe": lambda impl: check_gmm(impl, jnp.bfloat16, seed=4, **MOE),
    "dgrad_bf16_uneven": lambda impl: check_gmm(impl, jnp.bfloat16, seed=5, transpose=True, **UNEVEN),
    "dgrad_bf16_aligned": lambda impl: check_gmm(impl, jnp.bfloat16, seed=6, transpose=True, **ALIGNED),
    "tgmm_f32_uneven": lambda impl: check_tgmm(impl, jnp.float32, seed=7, **UNEVEN),
    "tgmm_bf16_aligned": lambda impl: check_tgmm(impl, jnp.bfloat16, seed=8, **ALIGNED),
    "grads_f32_uneven": lambda impl: check_gmm_grads(impl, jnp.float32, seed=9, **UNEVEN),
    "grads_bf16_aligned": lambda impl: check_gmm_grads(impl, jnp.bfloat16, seed=10, **ALIGNED),
    "permute_combine_f32": lambda impl: check_permute_combine(impl, jnp.float32, 1000, 6, 200, seed=11),
    "permute_combine_bf16": lambda impl: check_permute_combine(impl, jnp.bfloat16, 4096, 6, 2048, seed=12),
}


def run_check(name, impl):
    """(status, rel_err, note): pass / FAIL / error, and which backend actually ran if it fell back."""
    dtype = "float32" if "f32" in name else "bfloat16"
    dispatch.reset_warnings()
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            err = CHECKS[name](impl)
        notes = sorted(
            {str(w.message).split("using ")[-1].strip("'") for w in caught if "unavailable" in str(w.message)}
        )
        status = "pass" if err <= TOL[dtype] else "FAIL"
        return {"status": status, "rel_err": err, "fallback": notes, "seconds": time.perf_counter() - t0}
    except Exception as e:  # every failure is a table entry
        return {
            "status": "error",
            "error": f"{type(e).__name__}: {e}"[:500],
            "trace": traceback.format_exc()[-2000:],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="pallas,triton,mgpu,xla")
    p.add_argument(
        "--checks", default=",".join(CHECKS), help="comma-separated subset of: " + ",".join(CHECKS)
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    backends = args.backends.split(",")
    checks = args.checks.split(",")
    env = environment()
    results = {b: {} for b in backends}
    reasons = {b: dispatch.IMPLEMENTATIONS[b].unavailable_reason() for b in backends}
    print(json.dumps(env), flush=True)
    for b in backends:
        for c in checks:
            if c.startswith("permute") and b in ("triton", "mgpu"):
                continue  # no permute kernels of their own (they run pallas's)
            r = run_check(c, b)
            results[b][c] = r
            print(
                f"{b:7s} {c:22s} {r['status']:5s} {r.get('rel_err', float('nan')):.2e} {r.get('fallback') or ''} {r.get('error', '')}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {**env, "backends_unavailable": reasons, "tolerance": TOL, "results": results}, f, indent=1
            )

    def cell(r):
        if r is None:
            return "-"
        if r["status"] == "error":
            return "error"
        fb = f" fb->{r['fallback'][-1]}" if r["fallback"] else ""
        return f"{r['status']} {r['rel_err']:.1e}{fb}"

    print(f"\n{env['device']}  jax {env['jax']}  (tolerance f32 {TOL['float32']}, bf16 {TOL['bfloat16']})")
    for b, why in reasons.items():
        if why:
            print(f"  {b}: unavailable here ({why}); its rows show the fallback")
    width = max(len(c) for c in checks)
    print("check".ljust(width) + "".join(f" | {b:^22s}" for b in backends))
    for c in checks:
        print(c.ljust(width) + "".join(f" | {cell(results[b].get(c)):^22s}" for b in backends))


if __name__ == "__main__":
    main()
