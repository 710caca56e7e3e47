"""The expert-parallel exchange alone on the GPUs of one host: our transports against NCCL's own.

    python3 scripts/bench_exchange.py jax --out jax.json              # one process, every GPU
    torchrun --nproc_per_node 4 scripts/bench_exchange.py torch --out torch.json
    python3 scripts/bench_exchange.py table jax.json torch.json [...]  # one table, ratios to NCCL

Routing cases (rows of D=2048 bf16 from GPU s to GPU d; `--rows` per pair, 16,384 by default):
  uniform        every pair the same;
  hot_pair       GPU 0 sends 3x to GPU 1;
  hot_receiver   every other GPU sends 2x to GPU 0.
Paths:
  nccl           torch.distributed.all_to_all_single with exact splits (one process per GPU): the peer;
  dense          jax.lax.all_to_all of [P, C, D] with C the fullest pair: what the `bucketed`
                 transport moves when its buffer rung is exactly the need;
  exact<k>       our `exact` transport (moe/exchange.py): ragged_all_to_all with k updates per peer;
  ragged1        the same with one update per peer (XLA's one-shot kernel as one calls it plainly);
  push<g>        our `push` kernel (kernels/push/mgpu.py): each GPU writes its rows into its peers'
                 receive buffers over NVLink from g CTAs (Pallas Mosaic GPU, one process);
  push<g>x<u>    the same with each peer's rows as u updates (expert-major arrival writes one update
                 per (peer, local expert)).
Timing: N back-to-back exchanges inside one compiled loop (JAX) or between two CUDA events (torch),
for N = 5 and 25; the time of one is (t25 - t5) / 20, so launch and sync costs cancel. Correctness:
before timing, every JAX path moves random rows of a small case (`--check-rows` per pair) and the
received buffers are compared with NumPy, bit for bit.
GB/s is counted on routed bytes: what the busiest GPU sends or receives off itself, per second.
Wire bytes are per GPU: dense (P-1) x C rows each way, exact and NCCL the routed rows (busiest GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

CASES = ("uniform", "hot_pair", "hot_receiver")
D = 2048
ROW_BYTES = 2 * D  # bf16


def matrix(case: str, peers: int, rows: int) -> np.ndarray:
    """[source, destination] rows of one routing case."""
    m = np.full((peers, peers), rows, np.int64)
    if case == "hot_pair":
        m[0, 1] = 3 * rows
    elif case == "hot_receiver":
        m[1:, 0] = 2 * rows
    return m


def routed_bound(m: np.ndarray) -> int:
    """Bytes the busiest GPU sends or receives off itself."""
    off = m * (1 - np.eye(m.shape[0], dtype=m.dtype))
    return int(max(off.sum(0).max(), off.sum(1).max())) * ROW_BYTES


# ----------------------------------------------------------------------------------------- JAX


def _jax_paths(peers: int, updates: list[int], push_specs: list[str]):
    """{name: build(m) -> (fn, make_input, wire_bytes)}; fn(x, n) runs n exchanges in one program."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from xmoe_jax.moe import exchange as ex
    from xmoe_jax.moe.transports import get

    exact_t = get("exact")  # its mover reads ex.UPDATES_PER_PEER at trace time

    mesh = jax.make_mesh((peers,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = PartitionSpec("x")

    def dense(m):
        chunk = int(m.max())

        def body(x_PCD, loops):
            return jax.lax.fori_loop(0, loops, lambda _, x: jax.lax.all_to_all(x, "x", 0, 0), x_PCD)

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec))

        def make(key):
            x = jax.random.normal(key, (peers * peers, chunk, D), jnp.bfloat16)
            return jax.device_put(x, NamedSharding(mesh, spec))

        return fn, make, (peers - 1) * chunk * ROW_BYTES

    def exact(m, k):
        rows = int(max(m.sum(0).max(), m.sum(1).max()))
        sizes = jnp.asarray(m, jnp.int32)

        def body(x_ND, loops):
            me = jax.lax.axis_index("x")
            plan = ex.plan_from_sizes(sizes, sizes, me)
            old = ex.UPDATES_PER_PEER
            ex.UPDATES_PER_PEER = k  # read at trace time
            try:
                step = lambda _, x: ex.exchange(x, plan, rows, rows, "x", exact_t, int(m.max()))  # noqa: E731
                return jax.lax.fori_loop(0, loops, step, x_ND)
            finally:
                ex.UPDATES_PER_PEER = old

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec))

        def make(key):
            x = jax.random.normal(key, (peers * rows, D), jnp.bfloat16)
            return jax.device_put(x, NamedSharding(mesh, spec))

        return fn, make, routed_bound(m)  # exactly the routed rows

    def push(m, ctas, pieces, tuning):
        from xmoe_jax.kernels.push import push_rows

        rows = int(max(m.sum(0).max(), m.sum(1).max()))
        sizes = jnp.asarray(m, jnp.int32)
        max_piece = -(-int(m.max()) // pieces)

        def body(x_ND, loops):
            me = jax.lax.axis_index("x")
            plan = ex.plan_from_sizes(sizes, sizes, me)
            size_X, src_X = ex.split_updates(plan.send_sizes_P, plan.input_offsets_P, pieces)
            _, dst_X = ex.split_updates(plan.send_sizes_P, plan.output_offsets_P, pieces)
            meta_3X = jnp.stack([src_X, size_X, dst_X])
            step = lambda _, x: push_rows(  # noqa: E731
                x,
                meta_3X,
                out_rows=rows,
                axis_name="x",
                num_peers=peers,
                max_piece=max_piece,
                num_ctas=ctas,
                **tuning,
            )
            return jax.lax.fori_loop(0, loops, step, x_ND)

        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec, check_vma=False)
        )

        def make(key):
            x = jax.random.normal(key, (peers * rows, D), jnp.bfloat16)
            return jax.device_put(x, NamedSharding(mesh, spec))

        return fn, make, routed_bound(m)  # exactly the routed rows

    paths = {"dense": dense}
    for k in updates:
        paths[f"exact{k}" if k > 1 else "ragged1"] = lambda m, k=k: exact(m, k)
    for spec_ in push_specs:  # CTAS[xUPDATES][bKIB][sSTAGES], e.g. 64, 32x16, 64b64s3
        parts = re.fullmatch(r"(\d+)(?:x(\d+))?(?:b(\d+))?(?:s(\d+))?", spec_)
        if parts is None:
            raise SystemExit(f"--push {spec_!r}: expected CTAS[xUPDATES][bKIB][sSTAGES], e.g. 64x16b64s3")
        ctas, pieces, kib, stages = parts.groups()
        tuning = {
            k: v
            for k, v in (("block_bytes", kib and int(kib) * 1024), ("stages", stages and int(stages)))
            if v
        }
        paths[f"push{spec_}"] = lambda m, c=int(ctas), u=int(pieces or 1), t=tuning: push(m, c, u, t)
    return paths, mesh


def _check(paths, peers: int, rows: int) -> dict[str, bool]:
    """Each path's received rows equal NumPy's on a small skewed case (one exchange)."""
    import jax

    m = matrix("hot_pair", peers, rows)
    m[min(2, peers - 1), peers - 1] = 0  # an empty pair
    out = {}
    for name, build in paths.items():
        fn, make, _ = build(m)
        x = make(jax.random.key(7))
        got = np.asarray(jax.device_get(fn(x, 1)).astype(np.float32))
        src = np.asarray(jax.device_get(x).astype(np.float32))
        want = _expected(name, src, m, peers)
        if name.startswith("push"):  # the kernel leaves rows no peer sent unwritten: compare the sent ones
            filled = np.arange(got.shape[0] // peers)[None, :] < m.sum(0)[:, None]  # [dest, row]
            got, want = got[filled.reshape(-1)], want[filled.reshape(-1)]
        out[name] = bool(np.array_equal(got, want))
    return out


def _expected(name: str, src: np.ndarray, m: np.ndarray, peers: int) -> np.ndarray:
    if name == "dense":  # [P*P, C, D]: device s's block d goes to device d's block s
        blocks = src.reshape(peers, peers, *src.shape[1:])
        return blocks.transpose(1, 0, 2, 3).reshape(src.shape)
    rows = src.shape[0] // peers
    x = src.reshape(peers, rows, D)
    want = np.zeros_like(x)
    in_off = np.cumsum(m, 1) - m  # chunk of d in s's send buffer
    out_off = np.cumsum(m, 0) - m  # where s lands at d
    for s in range(peers):
        for d in range(peers):
            n = m[s, d]
            want[d, out_off[s, d] : out_off[s, d] + n] = x[s, in_off[s, d] : in_off[s, d] + n]
    return want.reshape(src.shape)


def run_jax(args) -> dict:
    from xmoe_jax.launch import xla_flags

    xla_flags.apply_defaults(transport="exact")  # XLA's one-shot ragged kernel, no decomposer
    import jax

    from xmoe_jax.perf.timing import environment

    peers = jax.device_count()
    push_specs = [p for p in args.push.split(",") if p]
    paths, _ = _jax_paths(peers, [int(k) for k in args.updates.split(",") if k], push_specs)
    if args.paths:
        paths = {k: v for k, v in paths.items() if k in args.paths.split(",")}
    result = {**environment(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "label": args.label}
    result["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    result["correct"] = _check(paths, peers, args.check_rows)
    rows = []
    for case in CASES:
        m = matrix(case, peers, args.rows)
        for name, build in paths.items():
            if name == "ragged1" and case != "uniform":
                continue  # 25-75 ms a call: one case says it
            fn, make, wire = build(m)
            x = make(jax.random.key(0))
            jax.block_until_ready(fn(x, 1))  # compile + warm
            times = {}
            for loops in (5, 25):
                best = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(x, loops))
                    best.append(time.perf_counter() - t0)
                times[loops] = min(best)
            sec = (times[25] - times[5]) / 20
            rows.append(_row(args.label or "jax", name, case, sec, m, wire))
            print(json.dumps(rows[-1]), flush=True)
    result["rows"] = rows
    return result


def _row(label, name, case, sec, m, wire) -> dict:
    return {
        "label": label,
        "path": name,
        "case": case,
        "ms": round(1e3 * sec, 4),
        "routed_GBps": round(routed_bound(m) / sec / 1e9, 1),
        "wire_bytes": int(wire),
        "routed_bytes": routed_bound(m),
    }


# --------------------------------------------------------------------------------------- torch


def run_torch(args) -> dict | None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, peers = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    for case in CASES:
        m = matrix(case, peers, args.rows)
        send, recv = m[rank].tolist(), m[:, rank].tolist()
        x = torch.randn(sum(send), D, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(sum(recv), D, dtype=torch.bfloat16, device="cuda")
        times = {}
        for loops in (5, 25):
            for _ in range(2):
                dist.all_to_all_single(y, x, recv, send)
            torch.cuda.synchronize()
            dist.barrier()
            best = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(loops):
                    dist.all_to_all_single(y, x, recv, send)
                end.record()
                torch.cuda.synchronize()
                best.append(start.elapsed_time(end) / 1e3)
            times[loops] = min(best)
        sec = torch.tensor((times[25] - times[5]) / 20, device="cuda")
        dist.all_reduce(sec, op=dist.ReduceOp.MAX)  # the slowest GPU finishes the exchange
        rows.append(_row("torch", "nccl", case, float(sec), m, routed_bound(m)))
    dist.destroy_process_group()
    if rank:
        return None
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "num_devices": peers,
        "rows": rows,
    }


# --------------------------------------------------------------------------------------- table


def table(paths: list[str]) -> str:
    rows, meta = [], []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        rows += data["rows"]
        meta.append({k: v for k, v in data.items() if k != "rows"})
    nccl = {r["case"]: r["ms"] for r in rows if r["path"] == "nccl"}
    lines = [
        "| run | path | case | ms | x NCCL | GB/s (routed, busiest GPU) | wire / routed |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['ms'] / nccl[r['case']]:.2f}" if r["case"] in nccl else ""
        lines.append(
            f"| {r['label']} | {r['path']} | {r['case']} | {r['ms']:.3f} | {ratio} | {r['routed_GBps']} "
            f"| {r['wire_bytes'] / r['routed_bytes']:.2f} |"
        )
    for m in meta:
        if "correct" in m:
            lines.append(
                f"\n{m.get('label') or 'jax'}: exact vs NumPy {m['correct']}; XLA_FLAGS={m['xla_flags']!r}"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("jax", "torch", "table"))
    p.add_argument("files", nargs="*", help="table: the JSON files of the runs")
    p.add_argument("--rows", type=int, default=16384, help="rows per GPU pair (uniform)")
    p.add_argument("--check-rows", type=int, default=512, help="rows per pair of the correctness case")
    p.add_argument("--updates", default="1,128,512,2048", help="exact: updates per peer to time (1: ragged1)")
    p.add_argument(
        "--push",
        default="",
        help="push kernel variants: CTAS[xUPDATES][bKIB][sSTAGES] each (e.g. 32,64x16,64b64s3)",
    )
    p.add_argument("--paths", default="", help="jax: only these paths (comma-separated names)")
    p.add_argument("--label", default="", help="a name for this run's rows (e.g. the flag variant)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.mode == "table":
        print(table(args.files))
        return 0
    result = run_jax(args) if args.mode == "jax" else run_torch(args)
    if result is not None and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
