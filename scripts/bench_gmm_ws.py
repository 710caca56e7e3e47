"""Our warp-specialized Mosaic-GPU grouped GEMM (xmoe_jax/kernels/gmm/mgpu_ws.py) against its peers.

    python scripts/bench_gmm_ws.py --out ws.json                  # one Hopper GPU, about 3 minutes
    python scripts/bench_gmm_ws.py --tiny --out ws.json           # CPU dry run: references only

Cases (bf16, the paper's Small expert shapes, 16,384 tokens x top-6 = 98,304 grouped rows): `ep1` 64
experts, `ep4` 16 local experts (what a GPU of EP 4 holds; with push's expert-major arrival its
GEMMs are plain grouped GEMMs like these); passes: the up-projection forward (K 2048, N 1408), the
down-projection forward (K 1408, N 2048) and the up-projection's data gradient (rhs transposed).
Group sizes: a random multinomial near uniform, all rows routed.

`--op tgmm`: our ws weight gradient (gmm/mgpu_ws_tgmm.py) instead, passes `up_wgrad` (lhs the rows' 2048 inputs,
grad their 1408 hidden gradients: dW [E, 2048, 1408]) and `down_wgrad` ([E, 1408, 2048]); every config of
TGMM_CONFIGS whose CTA tile divides the pass's dW is checked on a skewed case (empty groups, unaligned starts, rows
past the sum) against float32 per-group matmuls (empty groups must be exact zeros), then timed against the default
tgmm, a dense matmul of the same FLOPs and `torch._grouped_mm`'s 2d x 2d form (offsets along K). Full size is the
one-GPU step's 393,216 rows (`ep1`) and EP 4's 98,304 (`ep4`). `--check-only` and `--passes` narrow it.

Steps: 1. correctness first: every kernel config against a float32 XLA reference on a skewed case
(empty groups, rows past the sum), relative error on the rows < sum(group_sizes); 2. time a dense
matmul of the same FLOPs, the layer's default kernel (Pallas on GPU), JAX's Mosaic ragged dot, each
kernel config and `torch._grouped_mm` (CUTLASS) on the same rows; 3. print one table, TFLOP/s and
the ratio to torch. Every row goes to the JSON as it is measured.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # torch measures in the same process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from xmoe_jax.kernels import defaults, gmm, tgmm  # noqa: E402
from xmoe_jax.kernels.gmm import mgpu_ws, mgpu_ws_tgmm  # noqa: E402
from xmoe_jax.kernels.gmm.xla import gmm_xla  # noqa: E402
from xmoe_jax.perf.gather_bench import _torch_grouped_ms, torch_median_ms  # noqa: E402
from xmoe_jax.perf.recorder import Recorder  # noqa: E402
from xmoe_jax.perf.timing import environment, rel_err, time_fn  # noqa: E402

W = mgpu_ws.WsConfig
CONFIGS = {  # name: config (shared memory: stages x (cta_m + cta_n) x tile_k x 2 B, plus the output tiles)
    # measured first (results/gmm_ws_v1_1xh200.json): the best per pass of six
    "m64x128s5": W(64, 128, 64, 5, "m"),
    "m128x128s3": W(128, 128, 64, 3, "m"),
    "n128x64s4": W(128, 64, 64, 4, "n"),
    "n128x128s3": W(128, 128, 64, 3, "n"),
    # one wgmma left in flight per step
    "m64x128s5f1": W(64, 128, 64, 5, "m", in_flight=1),
    "m128x128s3f1": W(128, 128, 64, 3, "m", in_flight=1),
    "n128x64s4f1": W(128, 64, 64, 4, "n", in_flight=1),
    "n128x128s3f1": W(128, 128, 64, 3, "n", in_flight=1),
    # the epilogue in 64-column stores: room for a fourth stage at 256 x 128 and 128 x 256 (32 columns
    # faulted: a 64-byte shared-memory row is not 128-byte aligned for the bulk store)
    "m128x128s4e64f1": W(128, 128, 64, 4, "m", in_flight=1, epi_n=64),
    "n128x128s4e64f1": W(128, 128, 64, 4, "n", in_flight=1, epi_n=64),
    "m64x128s6e64f1": W(64, 128, 64, 6, "m", in_flight=1, epi_n=64),
}
PASSES = {  # name: (K, N, transpose_rhs)
    "up_fwd": (2048, 1408, False),
    "down_fwd": (1408, 2048, False),
    "up_dgrad": (1408, 2048, True),
}
TINY_PASSES = {"up_fwd": (256, 128, False), "down_fwd": (128, 256, False), "up_dgrad": (128, 256, True)}


def _randn(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def _sizes(rows: int, experts: int, seed: int, skewed: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if not skewed:
        return rng.multinomial(rows, np.ones(experts) / experts).astype(np.int32)
    p = rng.random(experts) ** 3
    p[rng.choice(experts, max(experts // 4, 1), replace=False)] = 0.0  # empty groups
    return rng.multinomial(int(rows * 0.9), p / p.sum()).astype(np.int32)  # 10% of rows past the sum


def _operands(rows, experts, k_dim, n_dim, transpose, seed):
    lhs = _randn(seed, (rows, k_dim))
    rhs = _randn(seed + 1, (experts, n_dim, k_dim) if transpose else (experts, k_dim, n_dim))
    return lhs, rhs


def check(rec, configs, rows, experts, on_gpu, passes):
    """Every config and pass on a skewed case against float32 XLA (rows < sum(group_sizes))."""
    for pass_, (k_dim, n_dim, transpose) in passes.items():
        gs = jnp.asarray(_sizes(rows, experts, 7, skewed=True))
        lhs, rhs = _operands(rows, experts, k_dim, n_dim, transpose, 11)
        live = int(gs.sum())
        f32 = jnp.float32
        ref = gmm_xla(lhs.astype(f32), rhs.astype(f32), gs, out_dtype=f32, transpose_rhs=transpose)
        for name, cfg in configs.items():
            if not on_gpu:
                rec.add(check=pass_, config=name, skipped="the kernel needs a Hopper GPU")
                continue
            try:
                fn = jax.jit(
                    lambda a, b, g, c=cfg, t=transpose: mgpu_ws.gmm_ws(a, b, g, config=c, transpose_rhs=t)
                )
                out = fn(lhs, rhs, gs)
                err = rel_err(np.asarray(out[:live], np.float32), np.asarray(ref[:live]))
                rec.add(check=pass_, config=name, rel_err=err, ok=bool(err < 1e-2))
            except Exception as e:  # a config that does not fit shared memory is a result
                rec.add(check=pass_, config=name, error=f"{type(e).__name__}: {str(e)[:300]}")


def _timed(rec, key, flops, iters, variant, fn, *args):
    """One timed row (ms, TFLOP/s) of fn(*args); a failure is a row too."""
    try:
        ms = time_fn(fn, *args, warmup=2, iters=iters) * 1e3
        rec.add(**key, variant=variant, ms=ms, tflops=flops / ms / 1e9)
    except Exception as e:
        rec.add(**key, variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}")


def bench(rec, configs, case, rows, experts, iters, on_gpu, use_torch, passes):
    gs_np = _sizes(rows, experts, 3, skewed=False)
    gs = jnp.asarray(gs_np)
    for pass_, (k_dim, n_dim, transpose) in passes.items():
        lhs, rhs = _operands(rows, experts, k_dim, n_dim, transpose, 5)
        flops = 2.0 * rows * k_dim * n_dim
        key = dict(case=case, pass_=pass_, rows=rows, experts=experts, k=k_dim, n=n_dim)

        timed = functools.partial(_timed, rec, key, flops, iters)

        dense_w = _randn(9, (k_dim, n_dim))
        timed("dense_same_flops", jax.jit(lambda a, b: a @ b), lhs, dense_w)
        ours = f"default_{defaults.default_implementation('gmm')}"  # the layer's kernel (pallas on GPU)
        timed(ours, jax.jit(lambda a, b, g, t=transpose: gmm(a, b, g, transpose_rhs=t)), lhs, rhs, gs)
        if on_gpu:
            timed(
                "jax_mosaic_ragged_dot",
                jax.jit(lambda a, b, g, t=transpose: gmm(a, b, g, transpose_rhs=t, implementation="mgpu")),
                lhs,
                rhs,
                gs,
            )
            for name, cfg in configs.items():
                fn = jax.jit(
                    lambda a, b, g, c=cfg, t=transpose: mgpu_ws.gmm_ws(a, b, g, config=c, transpose_rhs=t)
                )
                timed(f"ws_{name}", fn, lhs, rhs, gs)
        if use_torch and not transpose:
            ms = _torch_grouped_ms(rows, k_dim, n_dim, gs_np, iters)
            if ms is not None:
                rec.add(**key, variant="torch_grouped_mm", ms=ms, tflops=flops / ms / 1e9)


TGMM_PASSES = {"up_wgrad": (2048, 1408), "down_wgrad": (1408, 2048)}  # name: (M, N) of dW [E, M, N]
TINY_TGMM_PASSES = {"up_wgrad": (256, 128), "down_wgrad": (128, 256)}


def _tgmm_ref(lhs, grad, sizes) -> np.ndarray:
    """float32 per-group lhs[rows].T @ grad[rows] in NumPy (one compile per group shape would take minutes):
    [E, M, N]."""
    ends = np.cumsum(sizes)
    lhs, grad = np.asarray(lhs, np.float32), np.asarray(grad, np.float32)
    return np.stack([lhs[e - n : e].T @ grad[e - n : e] for n, e in zip(sizes, ends, strict=True)])


def _ws_tgmm(lhs, grad, gs, config):
    """The kernel itself (not the registry, which would hand a refused call to pallas)."""
    return mgpu_ws_tgmm.tgmm_ws(lhs, grad, gs, config=config)


TGMM_CONFIGS = {  # name: config; each pass checks and times those whose CTA tile divides its dW
    "m256x128": W(128, 128, 64, 4, "m", epi_n=64),  # defaults.WS_TGMM_CONFIGS: 1.15-1.20x Pallas (up)
    "n128x256": W(128, 128, 64, 4, "n", epi_n=64),  # 0.88-0.96x Pallas on the down-projection's dW
    "n128x128": W(128, 64, 64, 4, "n", epi_n=64),
    "m128x128": W(64, 128, 64, 5, "m", epi_n=64),  # not yet run: the down-projection's dW split along M
}


def _tgmm_configs(m_dim, n_dim, rows) -> dict:
    return {
        k: c
        for k, c in TGMM_CONFIGS.items()
        if mgpu_ws_tgmm.shape_reason(jnp.bfloat16, m_dim, n_dim, rows, c) is None
    }


def check_tgmm(rec, rows, experts, on_gpu, passes):
    """Each ws tgmm config on a skewed case against float32 per-group matmuls; empty groups must be exact zeros."""
    sizes = _sizes(rows, experts, 7, skewed=True)
    for pass_, (m_dim, n_dim) in passes.items():
        lhs, grad = _randn(11, (rows, m_dim)), _randn(12, (rows, n_dim))
        ref = _tgmm_ref(lhs, grad, sizes)
        for name, cfg in _tgmm_configs(m_dim, n_dim, rows).items():
            if not on_gpu:
                rec.add(check=pass_, config=name, skipped="the kernel needs a Hopper GPU")
                continue
            print(f"checking ws tgmm {pass_} {name}", flush=True)  # a hung kernel shows here
            try:
                out = np.asarray(
                    jax.jit(functools.partial(_ws_tgmm, config=cfg))(lhs, grad, sizes), np.float32
                )
                err = rel_err(out, ref)
                empty_zero = bool(np.all(out[sizes == 0] == 0))
                ok = bool(err < 1e-2 and empty_zero)
                rec.add(check=pass_, config=name, rel_err=err, empty_groups_zero=empty_zero, ok=ok)
            except Exception as e:
                rec.add(check=pass_, config=name, error=f"{type(e).__name__}: {str(e)[:600]}")


def _torch_tgmm_ms(rows, m_dim, n_dim, gs, iters) -> float | None:
    """torch._grouped_mm's 2d x 2d form (A [M, R] K-major, B [R, N], offsets along R), median ms; None if
    unavailable or refused."""
    try:
        import torch

        a = torch.randn(rows, m_dim, device="cuda", dtype=torch.bfloat16).t()
        b = torch.randn(rows, n_dim, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(np.cumsum(gs), device="cuda", dtype=torch.int32)
        return torch_median_ms(lambda: torch._grouped_mm(a, b, offs=offs), iters)
    except Exception as e:  # noqa: BLE001  (torch missing, or this form refused: no peer row)
        print(f"torch._grouped_mm 2d x 2d: {type(e).__name__}: {str(e)[:200]}")
        return None


def bench_tgmm(rec, case, rows, experts, iters, on_gpu, use_torch, passes):
    gs_np = _sizes(rows, experts, 3, skewed=False)
    gs = jnp.asarray(gs_np)
    for pass_, (m_dim, n_dim) in passes.items():
        lhs, grad = _randn(5, (rows, m_dim)), _randn(6, (rows, n_dim))
        flops = 2.0 * rows * m_dim * n_dim
        key = dict(case=case, pass_=pass_, rows=rows, experts=experts, k=m_dim, n=n_dim)

        timed = functools.partial(_timed, rec, key, flops, iters)

        timed("dense_same_flops", jax.jit(lambda a, b: a.T @ b), lhs, grad)
        ours = f"default_{defaults.default_implementation('tgmm')}"
        timed(ours, jax.jit(lambda a, b, g: tgmm(a, b, g)), lhs, grad, gs)
        for name, cfg in _tgmm_configs(m_dim, n_dim, rows).items() if on_gpu else ():
            timed(f"ws_tgmm_{name}", jax.jit(functools.partial(_ws_tgmm, config=cfg)), lhs, grad, gs)
        if use_torch and on_gpu:
            ms = _torch_tgmm_ms(rows, m_dim, n_dim, gs_np, iters)
            if ms is not None:
                rec.add(**key, variant="torch_grouped_mm", ms=ms, tflops=flops / ms / 1e9)


def table(rows) -> str:
    timed = [r for r in rows if "tflops" in r]
    out = ["| case / pass | variant | ms | TFLOP/s | x torch |", "|---|---|---:|---:|---:|"]
    for case, pass_ in dict.fromkeys((r["case"], r["pass_"]) for r in timed):
        group = [r for r in timed if (r["case"], r["pass_"]) == (case, pass_)]
        torch_ms = next((r["ms"] for r in group if r["variant"] == "torch_grouped_mm"), None)
        for r in group:
            ratio = f"{torch_ms / r['ms']:.2f}" if torch_ms else "-"
            out.append(f"| {case} {pass_} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {ratio} |")
    errs = [r for r in rows if "check" in r]
    worst = max((r.get("rel_err", 0.0) for r in errs), default=0.0)
    bad = [f"{r['check']}/{r['config']}" for r in errs if r.get("ok") is False or "error" in r]
    out.append(
        f"\ncorrectness: worst relative error {worst:.2e}; failed or refused: {', '.join(bad) or 'none'}"
    )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", default=None, help="comma-separated names of CONFIGS (default: all)")
    p.add_argument("--tiny", action="store_true", help="small shapes (the CPU dry run)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--op", choices=("gmm", "tgmm"), default="gmm")
    p.add_argument("--check-only", action="store_true", help="tgmm: the correctness check alone")
    p.add_argument("--passes", default=None, help="tgmm: comma-separated passes (default: both)")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    configs = {k: CONFIGS[k] for k in (args.configs.split(",") if args.configs else CONFIGS)}
    rec = Recorder(args.out, environment())
    if args.op == "tgmm":
        passes = TINY_TGMM_PASSES if args.tiny else TGMM_PASSES
        passes = {k: v for k, v in passes.items() if not args.passes or k in args.passes.split(",")}
        check_tgmm(rec, 504 if args.tiny else 16_376, 8 if args.tiny else 64, on_gpu, passes)
        if args.check_only:
            print(table(rec.rows))
            return
        for case, (rows, experts) in (
            {"ep1": (512, 8)} if args.tiny else {"ep1": (393_216, 64), "ep4": (98_304, 16)}
        ).items():
            bench_tgmm(rec, case, rows, experts, args.iters, on_gpu, not args.no_torch, passes)
        print(table(rec.rows))
        return
    rows, cases = (512, {"ep1": 8, "ep4": 4}) if args.tiny else (98_304, {"ep1": 64, "ep4": 16})
    passes = TINY_PASSES if args.tiny else PASSES
    check(
        rec, configs, rows - 72, cases["ep1"], on_gpu, passes
    )  # rows not a multiple of the tiles: a partial last tile
    for case, experts in cases.items():
        bench(rec, configs, case, rows, experts, args.iters, on_gpu, not args.no_torch, passes)
    print(table(rec.rows))


if __name__ == "__main__":
    main()
