"""Can the push exchange run under a GEMM? Our push kernel beside an independent GEMM, on one stream or two.

    python3 scripts/bench_push_overlap.py --out overlap.json      # one process, every GPU of the host

On every GPU, one compiled loop runs, per iteration, the push exchange of R rows x 2048 bf16 per peer pair
(uniform) and a GEMM [M, 2048] x [2048, 2048] that does not depend on it:
  gemm     the GEMM alone;
  alone    the exchange alone;
  serial   both, as XLA schedules them on its one compute stream (what the train step does today);
  stream   both, the exchange's kernel annotated to XLA's stream 1 (`jax.experimental.compute_on
           ("gpu_stream:1")`, XLA flag --xla_gpu_experimental_stream_annotation=true, set here), so XLA
           may run it beside the GEMM.
Per mode the time of one iteration is (t25 - t5) / 20 (launch and sync cancel), best of 3. The report:
hidden = (gemm + alone - both) / min(gemm, alone), the share of the shorter one that ran under the other
(0 = none, 1 = all). Correctness first: the exchange's rows in `stream` equal those of `alone` bit for bit.
Whether XLA wrapped the kernel in an async pair is read from the compiled HLO (`async_in_hlo`).
On CPU (a dry run: tests/test_gpu_batches.py style) the exchange runs its XLA reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

STREAM_FLAG = "--xla_gpu_experimental_stream_annotation=true"
D = 2048


def build(mode: str, peers: int, rows: int, gemm_rows: int):
    import jax
    import jax.numpy as jnp
    from jax._src import core
    from jax.experimental import compute_on as co
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xmoe_jax.kernels.push import push_rows

    mesh = Mesh(jax.devices()[:peers], ("x",))
    spec = PartitionSpec("x")
    src = jnp.arange(peers, dtype=jnp.int32) * rows
    meta_3X = jnp.stack(
        [src, jnp.full((peers,), rows, jnp.int32), src]
    )  # peer p: my rows p*R.. to its rows me*R..
    impl = None if jax.default_backend() == "gpu" else "xla"

    def exchange(x_ND):
        me = jax.lax.axis_index("x")
        meta = meta_3X.at[2].set(me * rows)  # I land at row me*R of every peer
        return push_rows(
            x_ND,
            meta,
            out_rows=peers * rows,
            axis_name="x",
            num_peers=peers,
            max_piece=rows,
            implementation=impl,
        )

    def on_stream(f):  # jax 0.10: compute_on2; later: compute_on, the same function form
        wrap = getattr(co, "compute_on2", None) or co.compute_on
        return wrap(f, compute_type="gpu_stream:1", out_memory_spaces=core.MemorySpace.Device)

    def body(x_ND, a_MD, w_DD, loops):
        def step(_, carry):
            x, a = carry
            if mode in ("alone", "serial", "stream"):
                if mode == "stream":
                    x = on_stream(exchange)(x)
                else:
                    x = exchange(x)
            if mode in ("gemm", "serial", "stream"):
                a = (a @ w_DD).astype(a.dtype)
            return x, a

        return jax.lax.fori_loop(0, loops, step, (x_ND, a_MD))

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, spec, PartitionSpec(), PartitionSpec()),
            out_specs=(spec, spec),
            check_vma=False,
        )
    )

    def make(key):
        kx, ka, kw = jax.random.split(key, 3)
        x = jax.device_put(
            jax.random.normal(kx, (peers * peers * rows, D), jnp.bfloat16), NamedSharding(mesh, spec)
        )
        a = jax.device_put(
            jax.random.normal(ka, (peers * gemm_rows, D), jnp.bfloat16), NamedSharding(mesh, spec)
        )
        w = jax.device_put(
            jax.random.normal(kw, (D, D), jnp.bfloat16) / D**0.5, NamedSharding(mesh, PartitionSpec())
        )
        return x, a, w

    return fn, make


def measure(fn, args, repeats: int = 3) -> float:
    import jax

    best = float("inf")
    for _ in range(repeats):
        t = {}
        for loops in (5, 25):
            jax.block_until_ready(fn(*args, loops))  # compiled and warm
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args, loops))
            t[loops] = time.perf_counter() - t0
        best = min(best, (t[25] - t[5]) / 20)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="rows per peer pair (uniform)")
    p.add_argument("--gemm-rows", type=int, default=65536, help="M of the GEMM per GPU")
    p.add_argument("--peers", type=int, default=0, help="GPUs (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if STREAM_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {STREAM_FLAG}".strip()

    import jax
    import numpy as np

    from xmoe_jax.perf.timing import environment

    peers = args.peers or jax.device_count()
    result = {
        **environment(),
        "xla_flags": os.environ["XLA_FLAGS"],
        "peers": peers,
        "rows": args.rows,
        "gemm_rows": args.gemm_rows,
        "times_ms": {},
    }
    outs = {}
    for mode in ("gemm", "alone", "serial", "stream"):
        fn, make = build(mode, peers, args.rows, args.gemm_rows)
        data = make(jax.random.key(0))
        if mode in ("alone", "stream"):
            outs[mode] = np.asarray(jax.device_get(fn(*data, 1)[0]).astype(np.float32))
        if mode == "stream":
            lowered = fn.lower(*data, 1)
            result["annotated"] = "_xla_stream_annotation" in lowered.as_text()
            hlo = lowered.compile().as_text()
            result["async_in_hlo"] = "async-start" in hlo or "async_start" in hlo
        result["times_ms"][mode] = 1e3 * measure(fn, data)
        print(f"{mode:7s} {result['times_ms'][mode]:.3f} ms", flush=True)
    result["stream_equals_alone"] = bool(np.array_equal(outs["alone"], outs["stream"]))
    t = result["times_ms"]
    shorter = min(t["gemm"], t["alone"])
    for mode in ("serial", "stream"):
        result[f"hidden_{mode}"] = (t["gemm"] + t["alone"] - t[mode]) / shorter
    print(
        f"stream == alone bit for bit: {result['stream_equals_alone']}; annotated: {result.get('annotated')}; "
        f"async pair in HLO: {result.get('async_in_hlo')}\n"
        f"hidden share of the shorter op: serial {result['hidden_serial']:.2f}, stream {result['hidden_stream']:.2f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
