"""FP8 grouped-GEMM measurements for scripts/bench_fp8.py: correctness on the device, kernel
throughput beside same-run baselines, and torch._scaled_grouped_mm on the same shapes.

Legend: R routed rows (tokens * top_k), K contraction, N output columns, E experts.
Every measurement is isolated (an OOM or a lowering failure is recorded as a result).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.fp8 import RECIPES, Recipe, gmm_fp8
from xmoe_jax.fp8.gmm import gmm_fp8_quantized
from xmoe_jax.fp8.operands import quantize_lhs, quantize_rhs
from xmoe_jax.kernels import defaults, gmm
from xmoe_jax.kernels.gmm.pallas_fp8 import gmm_fp8_pallas
from xmoe_jax.kernels.platform import interpret
from xmoe_jax.perf.recorder import Recorder  # noqa: F401  (scripts/bench_fp8.py: fp8_bench.Recorder)

# Expert shapes of the issue, up projection: Small (X-MoE: D=2048 F=1408 E=64 k=6) and Large
# (DeepSeek-V3: D=7168 F=2048 E=256 k=8) as one GPU of 8-way expert parallelism holds it: 32 local
# experts. The whole 256-expert stack on one GPU (3.8e9 weight elements) is past the Pallas kernels'
# 32-bit offsets; the registry then falls back to XLA's ragged dot, which asked for 224 GiB on an H100.
CONFIGS = {
    "small": dict(dim=2048, hidden=1408, experts=64, top_k=6, tokens=16384),
    "large": dict(dim=7168, hidden=2048, experts=32, top_k=8, tokens=8192),
}
ZIPF_S = 1.0
_NN = (((1,), (0,)), ((), ()))  # a[m, k] @ b[k, n]


def group_sizes(dist: str, rows: int, experts: int, seed: int = 0) -> np.ndarray:
    p = (
        np.ones(experts)
        if dist == "uniform"
        else np.random.default_rng(seed).permutation(1.0 / np.arange(1, experts + 1) ** ZIPF_S)
    )
    sizes = np.floor(p / p.sum() * rows).astype(np.int64)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return sizes


def randn(seed, shape, scale=1.0, dtype=jnp.bfloat16):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def check(rec: Recorder, rows: int = 3000, k: int = 1024, n: int = 704) -> bool:
    """FP8 kernel (pallas) against the dequantizing oracle (xla) on the device, every recipe,
    forward and both backward outputs, e4m3 and e5m2 gradients. Relative max errors."""
    ok = True
    x, w, g = randn(1, (rows, k)), randn(2, (8, k, n), 0.03), randn(3, (rows, n))
    gs = jnp.asarray(group_sizes("zipf", rows - rows // 10, 8), jnp.int32).at[1].set(0)  # an empty group
    gs = gs.at[0].add(rows - rows // 10 - gs.sum())  # sum < R: a zero tail
    for name in RECIPES:
        for grad_format in ("e4m3", "e5m2"):
            recipe = Recipe(name, grad_format=grad_format)

            def run(impl, x, w, g, recipe=recipe):
                out, vjp = jax.vjp(  # zeros past the groups: compared whole against the oracle
                    lambda a, b, i=impl: gmm_fp8(a, b, gs, recipe, implementation=i, zero_unwritten=True),
                    x,
                    w,
                )
                return (out, *vjp(g))

            try:
                got = jax.jit(lambda *a: run("pallas", *a))(x, w, g)
                ref = jax.jit(lambda *a: run("xla", *a))(x, w, g)
                exact = jax.jit(
                    lambda a, b: gmm(a.astype(jnp.float32), b.astype(jnp.float32), gs, zero_unwritten=True)
                )(x, w)
                errs = [
                    float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32)))
                          / jnp.max(jnp.abs(v.astype(jnp.float32))))
                    for u, v in zip(got, ref, strict=True)
                ]  # fmt: skip
                fp8_vs_exact = float(
                    jnp.max(jnp.abs(ref[0].astype(jnp.float32) - exact)) / jnp.max(jnp.abs(exact))
                )
                passed = max(errs) < 2e-2
                ok &= passed
                rec.add(kind="check", recipe=name, grad_format=grad_format, out_err=errs[0], dx_err=errs[1],
                        dw_err=errs[2], oracle_vs_unquantized=fp8_vs_exact, passed=passed)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                ok = False
                rec.add(
                    kind="check",
                    recipe=name,
                    grad_format=grad_format,
                    error=f"{type(e).__name__}: {str(e)[:600]}",
                )
    return ok


BENCH_RECIPES = (*(Recipe(name) for name in RECIPES), Recipe("rowwise", fast_accum=True))


def _config(cname: str):
    """(rows, K, N, experts, forward FLOPs, the rows' key) of an expert shape in CONFIGS."""
    cfg = CONFIGS[cname]
    rows, k, n, e = cfg["tokens"] * cfg["top_k"], cfg["dim"], cfg["hidden"], cfg["experts"]
    return rows, k, n, e, 2.0 * rows * k * n, dict(config=cname, rows=rows, k=k, n=n, experts=e)


def _dense_fp8_rows(rec, a8, b8, flops, iters, key, out_dtypes=(jnp.bfloat16,)) -> None:
    """XLA's dense FP8 dot (cuBLASLt on GPU) of the same FLOPs, per output dtype."""
    for dt in out_dtypes:
        fn = jax.jit(lambda a, b, dt=dt: jax.lax.dot_general(a, b, _NN, preferred_element_type=dt))
        kind = f"dense_fp8_xla_{'bf16' if dt == jnp.bfloat16 else 'f32'}out"
        rec.measure(fn, (a8, b8), flops, iters, **key, kind=kind, dist="-")


def _gmm_bf16_row(rec, x, w, gs, flops, iters, key) -> None:
    rec.measure(jax.jit(lambda x, w, gs: gmm(x, w, gs)), (x, w, gs), flops, iters, **key, kind="gmm_bf16_fwd")


def label(recipe: Recipe) -> str:
    return recipe.name + ("+fast_accum" if recipe.fast_accum else "")


def bench(rec: Recorder, configs, dists, iters: int) -> None:
    for cname in configs:
        rows, k, n, e, flops, key = _config(cname)
        x, w, g = randn(1, (rows, k)), randn(2, (e, k, n), 0.02), randn(3, (rows, n))
        rec.measure(jax.jit(lambda a, b: a @ b), (x, w[0]), flops, iters, **key, kind="dense_bf16", dist="-")
        b8 = randn(5, (k, n)).astype(jnp.float8_e4m3fn)
        _dense_fp8_rows(rec, x.astype(jnp.float8_e4m3fn), b8, flops, iters, key, (jnp.bfloat16, jnp.float32))
        del b8
        for dist in dists:
            gs = jnp.asarray(group_sizes(dist, rows, e), jnp.int32)
            k2 = dict(key, dist=dist)
            _gmm_bf16_row(rec, x, w, gs, flops, iters, k2)

            def fwd_bwd_bf16(x, w, g, gs):
                out, vjp = jax.vjp(lambda a, b: gmm(a, b, gs), x, w)
                return out, vjp(g)

            rec.measure(jax.jit(fwd_bwd_bf16), (x, w, g, gs), 3 * flops, iters, **k2, kind="gmm_bf16_fwdbwd")
            for recipe in BENCH_RECIPES:
                name = label(recipe)
                xq, xs = jax.jit(lambda x, r=recipe: quantize_lhs(x, r, r.act_dtype))(x)
                wq, ws = jax.jit(lambda w, r=recipe: quantize_rhs(w, r, r.act_dtype))(w)
                bk = recipe.block_k if xs.shape[1] > 1 else 0
                kern = jax.jit(lambda *a, bk=bk, ia=recipe.imprecise_acc: gmm_fp8_quantized(
                    *a, block_k=bk, out_dt=jnp.bfloat16, imprecise_acc=ia))  # fmt: skip
                rec.measure(
                    kern, (xq, xs, wq, ws, gs), flops, iters, **k2, kind="fp8_kernel_fwd", recipe=name
                )
                del xq, xs, wq, ws
                f = jax.jit(lambda x, w, gs, r=recipe: gmm_fp8(x, w, gs, r))
                rec.measure(f, (x, w, gs), flops, iters, **k2, kind="gmm_fp8_fwd", recipe=name)

                def fwd_bwd(x, w, g, gs, r=recipe):
                    out, vjp = jax.vjp(lambda a, b: gmm_fp8(a, b, gs, r), x, w)
                    return out, vjp(g)

                rec.measure(jax.jit(fwd_bwd), (x, w, g, gs), 3 * flops, iters, **k2, kind="gmm_fp8_fwdbwd",
                            recipe=name)  # fmt: skip
        del x, w, g


# The FP8 kernel's variants (scripts/bench_fp8.py --sweep): tensor-core accumulation length before
# each float32 add (kernels/gmm/fp8_dot.py; 0 is what Pallas's plain dot lowers to), weight
# layout (K-major: Hopper FP8 wgmma's native B operand), tile and launch.
IMPRECISE_ACC = (0, 128, 1 << 30)
TILES = ((128, 128, 256), (128, 128, 128), (256, 128, 128), (128, 256, 128))
LAUNCHES = ((8, 4), (8, 3))


def bench_variants(rec: Recorder, configs, dists, iters: int) -> None:
    """FP8 kernel alone (operands quantized beforehand) per recipe x accumulation x layout at the
    default tile, each with its error against the float32 oracle (max |out - ref| / max |ref|),
    then a tile / launch sweep of the rowwise K-major kernel; bf16 gmm and XLA's dense FP8 dot of
    the same FLOPs as baselines in the same run."""
    tile0 = defaults.default_tile("pallas", "gmm_fp8")
    for cname in configs:
        rows, k, n, e, flops, key = _config(cname)
        x, w = randn(1, (rows, k)), randn(2, (e, k, n), 0.02)
        _dense_fp8_rows(rec, x.astype(jnp.float8_e4m3fn), w[0].astype(jnp.float8_e4m3fn), flops, iters, key)
        for dist in dists:
            gs = jnp.asarray(group_sizes(dist, rows, e), jnp.int32)
            k2 = dict(key, dist=dist)
            _gmm_bf16_row(rec, x, w, gs, flops, iters, k2)
            for name in ("rowwise", "blockwise"):
                recipe = Recipe(name)
                xq, xs = jax.jit(lambda x, r=recipe: quantize_lhs(x, r, r.act_dtype))(x)
                wq, ws = jax.jit(lambda w, r=recipe: quantize_rhs(w, r, r.act_dtype))(w)
                wq_t = jnp.swapaxes(wq, 1, 2)
                bk = recipe.block_k if xs.shape[1] > 1 else 0
                ref = jax.jit(lambda *a, bk=bk: gmm_fp8_quantized(*a, block_k=bk, out_dt=jnp.float32, impl="xla"))(
                    xq, xs, wq, ws, gs)  # fmt: skip

                ops = (xq, xs, wq, wq_t, ws, gs)
                run = functools.partial(_variant, rec, ops, ref, flops, iters, dict(k2, recipe=name))
                layouts = (False, True) if name == "rowwise" and dist == "uniform" else (True,)
                accs = IMPRECISE_ACC if name == "rowwise" else IMPRECISE_ACC[:2]  # blockwise: bk = 128
                for kmajor in layouts:
                    for acc in accs if dist == "uniform" else accs[1:]:
                        run("fp8_kernel_variant", tile0, 8, 4, kmajor, acc)
                if name == "rowwise" and dist == "uniform":
                    for acc in IMPRECISE_ACC[1:]:
                        for tile in TILES:
                            for warps, stages in LAUNCHES:
                                run("sweep_fp8_kernel", tile, warps, stages, True, acc)
                del xq, xs, wq, ws, wq_t, ref, ops, run
        del x, w


def _variant(rec, ops, ref, flops, iters, key, kind, tile, warps, stages, kmajor, acc) -> None:
    """One FP8 kernel variant: its TFLOP/s, and its error against the oracle's output `ref`."""
    xq, xs, wq, wq_t, ws, gs = ops
    fn = jax.jit(lambda *a: gmm_fp8_pallas(
        *a, out_dtype=jnp.float32, tile=tile, transpose_rhs=kmajor, num_warps=warps, num_stages=stages,
        imprecise_acc=acc, interpret=interpret()))  # fmt: skip
    args = (xq, xs, wq_t if kmajor else wq, ws, gs)
    row = dict(key, kind=kind, kmajor=kmajor, imprecise_acc=acc, tile=list(tile), warps=warps, stages=stages)
    if rec.measure(fn, args, flops, iters, **row):
        rec.rows[-1]["rel_err"] = float(jnp.max(jnp.abs(fn(*args) - ref)) / jnp.max(jnp.abs(ref)))


def bench_dense(rec: Recorder, iters: int, rows: int = 32768, k: int = 2048, n: int = 2048) -> None:
    """A dense projection (attention q/k/v/o, dense MLP) forward and forward+backward: bf16 matmul
    against dot_fp8 per recipe (fp8/dense.py: XLA's FP8 dot, or the FP8 kernel for blockwise)."""
    from xmoe_jax.fp8 import dot_fp8

    x, w, g = randn(1, (rows, k)), randn(2, (k, n), 0.02), randn(3, (rows, n))
    flops = 2.0 * rows * k * n
    key = dict(config="dense_proj", rows=rows, k=k, n=n)

    def fwd_bwd(fn):
        def run(x, w, g):
            out, vjp = jax.vjp(fn, x, w)
            return out, vjp(g)

        return jax.jit(run)

    cases = {"bf16": lambda a, b: a @ b}
    recipes = {name: Recipe(name) for name in RECIPES}
    cases.update({name: (lambda a, b, r=r: dot_fp8(a, b, r)) for name, r in recipes.items()})
    for name, fn in cases.items():
        rec.measure(jax.jit(fn), (x, w), flops, iters, **key, kind="dense_fwd", recipe=name)
        rec.measure(fwd_bwd(fn), (x, w, g), 3 * flops, iters, **key, kind="dense_fwdbwd", recipe=name)


def bench_torch(rec: Recorder, configs, dists, iters: int) -> None:
    """torch._scaled_grouped_mm (rowwise scales, cuBLAS/CUTLASS grouped FP8 GEMM) and torch's
    bf16 torch._grouped_mm on the same shapes; kernel only (operands quantized beforehand)."""
    import torch

    rec.meta["torch"] = torch.__version__
    dev = "cuda"

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    for cname in configs:
        cfg = CONFIGS[cname]
        rows, k, n, e = cfg["tokens"] * cfg["top_k"], cfg["dim"], cfg["hidden"], cfg["experts"]
        flops = 2.0 * rows * k * n
        a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        b_t = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) * 0.02  # [E, N, K]: K-major
        fmax = torch.finfo(torch.float8_e4m3fn).max
        a_s = a.abs().amax(1).float().clamp(min=1e-12) / fmax
        a8 = (a.float() / a_s[:, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        b_s = b_t.abs().amax(2).float().clamp(min=1e-12) / fmax  # [E, N]
        b8 = (b_t.float() / b_s[:, :, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        for dist in dists:
            sizes = group_sizes(dist, rows, e)
            sizes16 = (sizes // 16) * 16  # offsets must be multiples of 16
            sizes16[np.argmax(sizes16)] += rows - sizes16.sum()
            offs = torch.tensor(np.cumsum(sizes16), device=dev, dtype=torch.int32)
            key = dict(config=cname, rows=rows, k=k, n=n, experts=e, dist=dist)
            for kind, fn in _torch_cases(torch, a, b_t, a8, b8, a_s, b_s, offs).items():
                try:
                    seconds = timed(fn)
                    rec.add(**key, kind=kind, ms=seconds * 1e3, tflops=flops / seconds / 1e12)
                except Exception as ex:  # noqa: BLE001
                    rec.add(**key, kind=kind, error=f"{type(ex).__name__}: {str(ex)[:400]}")


def _torch_cases(torch, a, b_t, a8, b8, a_s, b_s, offs) -> dict:
    """torch's grouped GEMMs; B is passed as [E, K, N] views of K-major [E, N, K] storage."""
    return {
        "torch_scaled_grouped_mm_rowwise": lambda: torch._scaled_grouped_mm(
            a8, b8.transpose(-2, -1), a_s, b_s, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "torch_grouped_mm_bf16": lambda: torch._grouped_mm(a, b_t.transpose(-2, -1), offs=offs),
    }
