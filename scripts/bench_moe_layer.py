"""One MoE layer, forward and forward+backward: pft vs padded (cf 1.0, 1.25) vs dense.

    python scripts/bench_moe_layer.py --tokens-per-device 16384 --out results.json
    XMOE_RAGGED_A2A=sendrecv python scripts/bench_moe_layer.py ...   # another exchange preset

Small expert shapes (D=2048, F=1408, E=64, k=6, GELU), bf16, expert parallelism over
all local devices. Prints time, tokens/s, useful TFLOP/s, temporary (activation)
memory from the compiled program, collective bytes from its HLO and the pft wire
bytes, for uniform and skewed routing; then the exchange alone against a dense
all_to_all of the same rows; the same-run dense matmul ceiling; ratios last.
"""

from __future__ import annotations

import argparse
import json

from xmoe_jax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402

from xmoe_jax.bench_moe import exchange_case, moe_layer_case, small_shapes  # noqa: E402
from xmoe_jax.benchmarking import dense_matmul_tflops, environment  # noqa: E402
from xmoe_jax.config import MeshConfig  # noqa: E402
from xmoe_jax.sharding import make_mesh  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-device", type=int, default=16384)
    p.add_argument(
        "--modes", default="pft,padded:1.25,padded:1.0,dense", help="comma list of dispatch[:capacity_factor]"
    )
    p.add_argument("--skews", default="0,1.0")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    mesh = make_mesh(MeshConfig(data=1, expert=jax.device_count()))
    num_tokens = args.tokens_per_device * jax.device_count()
    rows = []
    for skew in (float(s) for s in args.skews.split(",")):
        for mode in args.modes.split(","):
            name, _, cf = mode.partition(":")
            cfg, dim = small_shapes(dispatch=name, capacity_factor=float(cf) if cf else None)
            try:
                rows.append(moe_layer_case(cfg, dim, num_tokens, mesh, skew, iters=args.iters))
            except Exception as err:  # record and go on: one failing mode must not hide the rest
                rows.append(
                    {
                        "dispatch": name,
                        "capacity_factor": cfg.capacity_factor,
                        "skew": skew,
                        "error": f"{type(err).__name__}: {str(err)[:300]}",
                    }
                )
            print(json.dumps(rows[-1]), flush=True)
    exchanges = []
    if jax.device_count() > 1:
        per_pair = args.tokens_per_device * small_shapes()[0].top_k // jax.device_count()
        for transport in ("auto", "emulated"):
            try:
                exchanges.append(exchange_case(mesh, per_pair, 2048, transport))
            except Exception as err:
                exchanges.append({"transport": transport, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(json.dumps(exchanges[-1]), flush=True)
    result = {
        **environment(),
        "xla_flags": __import__("os").environ.get("XLA_FLAGS", ""),
        "tokens_per_device": args.tokens_per_device,
        "cases": rows,
        "exchange": exchanges,
        "dense_matmul_tflops": dense_matmul_tflops(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"\n{'skew':>4} {'mode':<12} {'fwd ms':>8} {'f+b ms':>8} {'tok/s':>10} {'TFLOP/s':>8} "
        f"{'temp GB':>8} {'drop':>6} {'a2a MB':>8}"
    )
    for r in rows:
        mode = f"{r['dispatch']}:{r['capacity_factor']}"
        if "error" in r:
            print(f"{r['skew']:>4} {mode:<12} {r['error'][:80]}")
            continue
        a2a = sum(v["bytes"] for k, v in r["collectives"].items() if "all-to-all" in k) / 1e6
        a2a = r.get("pft_wire_bytes_per_device", a2a * 1e6) / 1e6 if r["dispatch"] == "pft" else a2a
        print(
            f"{r['skew']:>4} {mode:<12} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>8.2f} {r['tokens_per_s']:>10.0f} "
            f"{r['useful_tflops_per_device']:>8.1f} {(r['temp_bytes'] or 0) / 1e9:>8.2f} {r['drop_rate']:>6.3f} "
            f"{a2a:>8.1f}"
        )
    for e in exchanges:
        print("exchange", json.dumps(e))
    print(f"dense matmul (same run): {result['dense_matmul_tflops']:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
