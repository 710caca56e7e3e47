"""The expert GEMMs with their exchanges inside (kernels/push: gmm_push, push_gmm) against the two in a row.

    python scripts/bench_gmm_push.py --out push.json        # 2+ Hopper GPUs of one host, one process
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/bench_gmm_push.py --tiny
                                                            # CPU dry run: the references only

Per GPU: T tokens x top-K routed over E experts on P GPUs (the paper's Small: 16,384 x 6 of 64, D 2048,
F 1408); the push transport's compact layout (layouts.compact, expert-major arrival) gives the plan, and
its reverse is the return. The receive buffer holds the busiest GPU's rows (no overflow). Rows:
  dense   a dense [S, F] x [F, D] matmul of the grouped GEMM's FLOPs (S: the busiest GPU's rows)
  gemm    the down-projection alone (our ws kernel), the floor for the fused kernel
  return  the return exchange alone (the push kernel)
  serial  gemm, then push: what training ran before
  fused   gmm_push: the GEMM's epilogue stores every row on the GPU it came from
Routings: `uniform`, and `skewed` (experts drawn with Zipf weights, s = 1: hot receivers). Passes: `down`, the
down-projection ([M, F] x [F, D]: the forward's return), and `dgrad`, the up-projection's data gradient ([M, F] x
[D, F]^T: the backward's d x, the kernel reading its weights transposed), each GEMM then its exchange.
The arrive passes run the exchange first, then the GEMM on what arrived (push_gmm, XMOE_FUSED_ARRIVE=on):
`up`, the dispatch and the first up-projection ([A, D] pushed, [M, D] x [D, F]), and `ddown`, the backward's
cotangent and d act ([M, D] x [F, D]^T); their `return` row is the exchange before the GEMM (the dispatch).
Correctness first: fused equals serial bit for bit on the rows sent (same tiles, same sums; for the
arrive passes, the GEMM's rows and the received rows), and both are compared with a float32 XLA
reference (relative error). Each time: (25 calls in one compiled loop
- 5) / 20, best of 3; every call reads the previous call's output, so none is hoisted.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xmoe_jax.kernels import gmm
from xmoe_jax.kernels.gmm.xla import gmm_xla
from xmoe_jax.kernels.push import gmm_push, push_gmm, push_rows
from xmoe_jax.kernels.push.api import ARRIVE_CTAS_ENV
from xmoe_jax.moe import layouts
from xmoe_jax.moe.capacity import expert_positions
from xmoe_jax.moe.exchange import push_meta
from xmoe_jax.moe.transports import get
from xmoe_jax.perf.recorder import Recorder
from xmoe_jax.perf.timing import environment

AXIS = "x"
SMALL = dict(tokens=16384, top_k=6, experts=64, dim=2048, hidden=1408)
TINY = dict(tokens=64, top_k=2, experts=8, dim=256, hidden=128)


def routing(case: str, peers: int, tokens: int, top_k: int, experts: int, seed: int = 0) -> np.ndarray:
    """int32 [P * T, K]: distinct experts per token; `skewed` draws them with Zipf weights (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    logits = np.zeros(experts) if case == "uniform" else -np.log(np.arange(1, experts + 1))
    keys = logits[None, :] + rng.gumbel(size=(peers * tokens, experts))
    return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int32)


def recv_rows(topk: np.ndarray, peers: int, experts: int) -> int:
    """The busiest GPU's received rows, rounded up to 128 (the buffer: nothing overflows)."""
    per_gpu = np.bincount(topk.reshape(-1) // (experts // peers), minlength=peers)
    return int(-(-per_gpu.max() // 128) * 128)


ARRIVE_PASSES = ("up", "ddown")


def _runner(body, mesh):
    """mode -> jit(shard_map) of (h, w, topk, pos, loops) -> body(..., mode) over the exchange axis."""
    spec = PartitionSpec(AXIS)

    def run(mode):
        return jax.jit(
            jax.shard_map(
                lambda h, w, t, p, n: body(h, w, t, p, n, mode),
                mesh=mesh,
                in_specs=(spec, spec, spec, spec, PartitionSpec()),
                out_specs=(spec, spec),
                check_vma=False,
            )
        )

    return run  # the exchange, then the GEMM on what arrived


def build(peers: int, shape: dict, num_recv: int, impl: str | None, transpose: bool, arrive: bool = False):
    """jit(shard_map): (h, w, topk, pos, loops, mode) -> (the output, the sent rows' mask); `transpose`:
    w is [E, D, F] read transposed (the up-projection's data gradient). `arrive`: h is the send buffer,
    the exchange runs first (the plan, not its reverse) and the output is (received rows, GEMM), masked
    on the grouped rows."""
    if arrive:
        return _build_arrive(peers, shape, num_recv, impl, transpose)
    mesh = jax.make_mesh((peers,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    push_t = get("push")

    def body(h_MF, w_LFD, topk_TK, pos_TK, loops, mode):
        keep_TK = jnp.ones(topk_TK.shape, bool)
        lay = layouts.compact(topk_TK, keep_TK, pos_TK, shape["experts"], num_recv, AXIS, peers, push_t)
        gs_L = lay.cc_PL.sum(0).astype(jnp.int32)
        rev = lay.plan.reverse()
        meta_3X = push_meta(rev)
        sent_A = (
            jnp.zeros((lay.num_send,), bool)
            .at[lay.dest_TK.reshape(-1)]
            .set(lay.sent_TK.reshape(-1), mode="drop")
        )
        kw = dict(out_rows=lay.num_send, axis_name=AXIS, num_peers=peers, max_piece=lay.max_piece)

        def op(h):
            if mode == "gemm":
                return gmm(h, w_LFD, gs_L, transpose_rhs=transpose)
            if mode == "return":
                return push_rows(h, meta_3X, **kw, implementation=impl)
            if mode == "serial":
                return push_rows(
                    gmm(h, w_LFD, gs_L, transpose_rhs=transpose), meta_3X, **kw, implementation=impl
                )
            if mode == "fused":
                return gmm_push(h, w_LFD, gs_L, meta_3X, **kw, transpose_rhs=transpose, implementation=impl)
            if mode == "reference":  # float32 GEMM, the push reference
                f32 = jnp.float32
                y = gmm_xla(h.astype(f32), w_LFD.astype(f32), gs_L, out_dtype=f32, transpose_rhs=transpose)
                return push_rows(y, meta_3X, **kw, implementation="xla")
            raise ValueError(mode)

        if mode == "return":  # rows of the GEMM's output width
            n_dim = w_LFD.shape[1 if transpose else 2]
            h_MF = jnp.tile(h_MF, (1, -(-n_dim // h_MF.shape[1])))[:, :n_dim]

        def step(_, carry):
            h, y = carry
            h = h.at[0, 0].set(y[0, 0].astype(h.dtype))  # each call reads the last one's output
            return h, op(h)

        y0 = op(h_MF)
        _, y = jax.lax.fori_loop(1, loops, step, (h_MF, y0)) if mode != "reference" else (h_MF, y0)
        return y, sent_A

    return _runner(body, mesh), mesh


def _build_arrive(peers: int, shape: dict, num_recv: int, impl: str | None, transpose: bool):
    mesh = jax.make_mesh((peers,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    push_t = get("push")

    def body(x_AD, w_LKN, topk_TK, pos_TK, loops, mode):
        keep_TK = jnp.ones(topk_TK.shape, bool)
        lay = layouts.compact(topk_TK, keep_TK, pos_TK, shape["experts"], num_recv, AXIS, peers, push_t)
        gs_L = lay.cc_PL.sum(0).astype(jnp.int32)
        plan = lay.plan
        meta_3X = push_meta(plan)
        grouped_M = jnp.arange(num_recv) < gs_L.sum()
        kw = dict(out_rows=num_recv, axis_name=AXIS, num_peers=peers, max_piece=lay.max_piece)
        x_MD = (
            jnp.zeros((num_recv, x_AD.shape[1]), x_AD.dtype)
            .at[: min(num_recv, x_AD.shape[0])]
            .set(x_AD[: min(num_recv, x_AD.shape[0])])
        )  # rows for the GEMM alone (their values do not matter to its time)

        def op(x):
            if mode == "gemm":
                return x_MD, gmm(x_MD.at[0, 0].set(x[0, 0]), w_LKN, gs_L, transpose_rhs=transpose)
            if mode == "return":
                r = push_rows(x, meta_3X, **kw, implementation=impl)
                return r, r
            if mode == "serial":
                r = push_rows(x, meta_3X, **kw, implementation=impl)
                return r, gmm(r, w_LKN, gs_L, transpose_rhs=transpose)
            if mode == "fused":
                return push_gmm(x, w_LKN, gs_L, meta_3X, **kw, transpose_rhs=transpose, implementation=impl)
            if mode == "reference":  # the push reference, float32 GEMM
                f32 = jnp.float32
                r = push_rows(x, meta_3X, **kw, implementation="xla")
                return r, gmm_xla(
                    r.astype(f32), w_LKN.astype(f32), gs_L, out_dtype=f32, transpose_rhs=transpose
                )
            raise ValueError(mode)

        def step(_, carry):
            x, out = carry
            x = x.at[0, 0].set(out[1][0, 0].astype(x.dtype))  # each call reads the last one's output
            return x, op(x)

        out0 = op(x_AD)
        _, out = jax.lax.fori_loop(1, loops, step, (x_AD, out0)) if mode != "reference" else (x_AD, out0)
        r, y = out
        return jnp.concatenate([r.astype(jnp.float32), y.astype(jnp.float32)], axis=1), grouped_M

    return _runner(body, mesh), mesh


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU dry run)")
    ap.add_argument("--cases", default="uniform,skewed")
    ap.add_argument(
        "--arrive-ctas",
        default="8,16,32",
        help="arrive passes: copying CTAs to time the fused kernel at (best kept)",
    )
    ap.add_argument(
        "--passes",
        default="down,dgrad",
        help="down: [M, F] x [F, D]; dgrad: [M, F] x [D, F]^T; up: push, then [M, D] x [D, F]; "
        "ddown: push, then [M, D] x [F, D]^T",
    )
    args = ap.parse_args()
    shape = TINY if args.tiny else SMALL
    peers = jax.device_count()
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and peers < 2:  # measured on one H200: results/arrive_1xh200_nvshmem.log
        raise SystemExit(
            "bench_gmm_push.py: 1 GPU visible; the push kernels write into peers and need 2+ GPUs of one host "
            "(with one device XLA routes the peer writes to NVSHMEM, which it does not support here)"
        )
    impl = None if on_gpu else "xla"
    rec = Recorder(args.out, {**environment(), "shape": shape, "peers": peers})
    rows = []
    for pass_, case in [(p, c) for p in args.passes.split(",") for c in args.cases.split(",")]:
        transpose = pass_ in ("dgrad", "ddown")
        arrive = pass_ in ARRIVE_PASSES
        topk = routing(case, peers, shape["tokens"], shape["top_k"], shape["experts"])
        num_recv = recv_rows(topk, peers, shape["experts"])
        run, mesh = build(peers, shape, num_recv, impl, transpose, arrive)
        on = NamedSharding(mesh, PartitionSpec(AXIS))
        keys = jax.random.split(jax.random.key(1), 2)
        # the GEMM's lhs rows: [M, F] from the experts (return passes), [A, D] sent (arrive passes)
        h_shape = (
            (peers * shape["tokens"] * shape["top_k"], shape["dim"])
            if arrive
            else (peers * num_recv, shape["hidden"])
        )
        h = jax.device_put(jax.random.normal(keys[0], h_shape, jnp.bfloat16), on)
        k_dim, n_dim = (shape["dim"], shape["hidden"]) if arrive else (shape["hidden"], shape["dim"])
        w_shape = (shape["experts"], n_dim, k_dim) if transpose else (shape["experts"], k_dim, n_dim)
        w = jax.random.normal(keys[1], w_shape, jnp.float32) * 0.03
        w = jax.device_put(w.astype(jnp.bfloat16), on)  # [P * L, ...]: GPU p holds experts p * L ...
        pos = np.concatenate(
            [
                np.asarray(expert_positions(jnp.asarray(t), jnp.ones(t.shape), shape["experts"], "position"))
                for t in np.split(topk, peers)
            ]
        )
        topk_d, pos_d = jax.device_put(topk, on), jax.device_put(pos, on)
        inputs = (h, w, topk_d, pos_d)
        outs = {m: run(m)(*inputs, 1) for m in ("serial", "fused", "reference")}
        sent = np.asarray(outs["fused"][1])
        got = {m: np.asarray(o[0].astype(jnp.float32))[sent] for m, o in outs.items()}
        ref = got["reference"]
        cols = slice(k_dim, None) if arrive else slice(None)  # the GEMM's columns (arrive: after the rows)
        err = {
            m: float(np.linalg.norm(got[m][:, cols] - ref[:, cols]) / np.linalg.norm(ref[:, cols]))
            for m in ("serial", "fused")
        }
        exact = bool(np.array_equal(got["fused"], got["serial"]))
        busiest = int(np.bincount(topk.reshape(-1) // (shape["experts"] // peers), minlength=peers).max())
        flops = 2 * busiest * shape["hidden"] * shape["dim"]  # the busiest GPU's grouped rows
        # the busiest sender's rows (arrive passes: a receiver's, whose rows all come over the exchange)
        sent_bytes = int(sent.reshape(peers, -1).sum(1).max()) * shape["dim"] * 2
        rec.add(
            case=case,
            pass_=pass_,
            kind="check",
            fused_equals_serial=exact,
            rel_err_fused=err["fused"],
            rel_err_serial=err["serial"],
            recv_rows=busiest,
        )
        times = {}
        if on_gpu:
            a = jax.random.normal(keys[0], (busiest, k_dim), jnp.bfloat16)
            b = jax.random.normal(keys[1], (k_dim, n_dim), jnp.bfloat16)
            dense = jax.jit(
                lambda a, b, n: jax.lax.fori_loop(
                    0, n, lambda _, x: (x[0].at[0, 0].set(x[1][0, 0]), x[0] @ b), (a, a @ b)
                )[1]
            )
            # arrive passes: the fused kernel at each count of copying CTAs (XMOE_ARRIVE_CTAS, read when traced)
            ctas = [int(c) for c in args.arrive_ctas.split(",")] if arrive else [None]
            fused_modes = [("fused", c) for c in ctas]
            for mode, c in [
                ("dense", None),
                ("gemm", None),
                ("return", None),
                ("serial", None),
                *fused_modes,
            ]:
                if c is not None:
                    os.environ[ARRIVE_CTAS_ENV] = str(c)
                fn = dense if mode == "dense" else run(mode)  # a fresh jit: traced with this count
                args_ = (a, b) if mode == "dense" else inputs
                jax.block_until_ready(fn(*args_, 2))  # compile and warm
                best = {}
                for loops in (5, 25):
                    ts = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(*args_, loops))
                        ts.append(time.perf_counter() - t0)
                    best[loops] = min(ts)
                took = (best[25] - best[5]) / 20
                rate = (
                    {"gb_s": sent_bytes / took / 1e9} if mode == "return" else {"tflops": flops / took / 1e12}
                )
                rec.add(case=case, pass_=pass_, kind="time", mode=mode, ms=took * 1e3, arrive_ctas=c, **rate)
                times[mode] = min(times.get(mode, took), took)  # fused: its best count of copying CTAs
            os.environ.pop(ARRIVE_CTAS_ENV, None)
            hidden = (times["serial"] - times["fused"]) / times["return"]
            rows.append((f"{pass_}, {case}", exact, err["fused"], times, hidden))
    if rows:
        print(
            "\n| pass, routing | fused == serial | rel err | dense ms | gemm ms | return ms | serial ms | fused ms | fused / serial | return hidden |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for case, exact, err_, t, hidden in rows:
            ms = " | ".join(f"{t[m] * 1e3:.3f}" for m in ("dense", "gemm", "return", "serial", "fused"))
            print(f"| {case} | {exact} | {err_:.2e} | {ms} | {t['fused'] / t['serial']:.3f} | {hidden:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
