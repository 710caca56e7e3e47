"""One MoE layer, forward and forward+backward: pft / rbd vs padded (cf 1.0, 1.25) vs dense.

    python scripts/bench_moe_layer.py --tokens-per-device 16384 --out results.json
    XMOE_RAGGED_A2A=sendrecv python scripts/bench_moe_layer.py ...   # another exchange preset
    # 4 GPUs as 2 nodes x 2, per-stage times of pft and rbd
    python scripts/bench_moe_layer.py --expert-nodes 2 --modes rbd,pft,padded:1.25 --stages pft,rbd

Small expert shapes (D=2048, F=1408, E=64, k=6, GELU), bf16, expert parallelism over
all local devices (factored into --expert-nodes nodes). Prints time, tokens/s, useful
TFLOP/s, temporary (activation) memory from the compiled program, collective bytes
from its HLO and the exchange wire bytes, for uniform and skewed routing; with
--stages, each listed dispatch's forward per stage (xmoe_jax/perf/stages.py); with
several nodes, the rows crossing the node axis under PFT and under RBD for the same
routing; then the exchange alone against a dense all_to_all of the same rows; the
same-run dense matmul ceiling; ratios last.
"""

from __future__ import annotations

import argparse
import json

from xmoe_jax.launch.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from xmoe_jax.config import MeshConfig, ParallelConfig  # noqa: E402
from xmoe_jax.moe.dispatchers import exchanges_tokens  # noqa: E402
from xmoe_jax.perf.moe_bench import (  # noqa: E402
    exchange_case,
    make_inputs,
    moe_layer_case,
    place_inputs,
    small_shapes,
)
from xmoe_jax.perf.stages import node_rows, stage_times  # noqa: E402
from xmoe_jax.perf.timing import dense_matmul_tflops, environment  # noqa: E402
from xmoe_jax.sharding import make_mesh  # noqa: E402


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def shapes(args, dispatch: str, capacity_factor: float | None = None):
    """Small shapes and the placement for `dispatch` (the command line's exchange options for pft / rbd)."""
    extra = {}
    if exchanges_tokens(dispatch):
        extra = {
            "transport": args.transport,
            "recv_buffer_factor": args.recv_buffer_factor,
            "overlap_chunks": args.overlap_chunks,
            "overlap": args.overlap,
        }
    cfg, dim = small_shapes(capacity_factor=capacity_factor)
    factor = extra.get("recv_buffer_factor")
    if factor is not None:
        extra["recv_buffer_factor"] = None if factor == "auto" else float(factor)
    return cfg, ParallelConfig(dispatch=dispatch, **extra), dim


def stage_cases(args, mesh, num_tokens: int, skew: float) -> list[dict]:
    """Per-stage forward times of each dispatch listed in --stages (dropless) at one skew."""
    out = []
    for name in filter(None, args.stages.split(",")):
        cfg, par, dim = shapes(args, name)
        params, x_TD = place_inputs(*make_inputs(cfg, dim, num_tokens, skew, jnp.bfloat16), par, mesh)
        try:
            out.append(
                {
                    "dispatch": name,
                    "skew": skew,
                    "stages": stage_times(cfg, par, mesh, params, x_TD, args.iters, args.stages_backward),
                }
            )
        except Exception as err:  # record and go on, as for the layer cases
            out.append({"dispatch": name, "skew": skew, "error": _error(err)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-device", type=int, default=16384)
    p.add_argument(
        "--modes", default="pft,padded:1.25,padded:1.0,dense", help="comma list of dispatch[:capacity_factor]"
    )
    p.add_argument("--skews", default="0,1.0")
    p.add_argument("--expert-nodes", type=int, default=1, help="factor the expert axis into nodes x local")
    p.add_argument("--stages", default="", help="comma list of dispatches (pft, rbd) to time per stage")
    p.add_argument("--stages-backward", action="store_true", help="also time each stage's forward+backward")
    p.add_argument("--no-exchange", action="store_true", help="skip the exchange-alone comparison")
    p.add_argument("--transport", default="auto", help="pft/rbd exchange: auto, ragged or emulated")
    p.add_argument(
        "--recv-buffer-factor",
        default=None,
        help="pft/rbd receive buffer factor; 'auto' = the smallest rung of the trainer's ladder that "
        "holds the measured peak (as adaptive training would settle); default: the worst case",
    )
    p.add_argument("--overlap-chunks", type=int, default=1, help="pft/rbd: dispatch the tokens in N chunks")
    p.add_argument(
        "--overlap",
        default="none",
        choices=["none", "shared", "chunks", "both"],
        help="pft/rbd: parallel.overlap (chunks, both: with --overlap-chunks >= 2; the XLA scheduler: "
        "XMOE_XLA_SCHEDULER=latency_hiding)",
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    mesh = make_mesh(MeshConfig(data=1, expert=jax.device_count(), expert_nodes=args.expert_nodes))
    num_tokens = args.tokens_per_device * jax.device_count()
    rows, stages, crossing = [], [], []
    for skew in (float(s) for s in args.skews.split(",")):
        stages += stage_cases(args, mesh, num_tokens, skew)
        if args.expert_nodes > 1:  # same routing for every dropless dispatch
            cfg, par, dim = shapes(args, "rbd")
            params, x_TD = place_inputs(*make_inputs(cfg, dim, num_tokens, skew, jnp.bfloat16), par, mesh)
            crossing.append({"skew": skew, "tokens": num_tokens, **node_rows(cfg, par, mesh, params, x_TD)})
            print(json.dumps(crossing[-1]), flush=True)
        for mode in args.modes.split(","):
            name, _, cf = mode.partition(":")
            cfg, par, dim = shapes(args, name, float(cf) if cf else None)
            try:
                settle = args.recv_buffer_factor == "auto" and exchanges_tokens(name)
                rows.append(
                    moe_layer_case(
                        cfg, par, dim, num_tokens, mesh, skew, iters=args.iters, settle_buffers=settle
                    )
                )
            except Exception as err:  # record and go on: one failing mode must not hide the rest
                rows.append(
                    {
                        "dispatch": name,
                        "capacity_factor": cfg.capacity_factor,
                        "skew": skew,
                        "error": _error(err),
                    }
                )
            print(json.dumps(rows[-1]), flush=True)
    exchanges = []
    if jax.device_count() > 1 and not args.no_exchange:
        per_pair = args.tokens_per_device * small_shapes()[0].top_k // jax.device_count()
        on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
        for transport in ("ragged", "emulated") if on_gpu else ("emulated",):
            try:
                exchanges.append(exchange_case(mesh, per_pair, 2048, transport))
            except Exception as err:
                exchanges.append({"transport": transport, "error": _error(err)})
            print(json.dumps(exchanges[-1]), flush=True)
    result = {
        **environment(),
        "xla_flags": __import__("os").environ.get("XLA_FLAGS", ""),
        "tokens_per_device": args.tokens_per_device,
        "transport": args.transport,
        "recv_buffer_factor": args.recv_buffer_factor,
        "mesh": dict(mesh.shape),
        "cases": rows,
        "stages": stages,
        "node_rows": crossing,
        "exchange": exchanges,
        "dense_matmul_tflops": dense_matmul_tflops(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"\n{'skew':>4} {'mode':<22} {'fwd ms':>8} {'f+b ms':>8} {'tok/s':>10} {'TFLOP/s':>8} "
        f"{'temp GB':>8} {'drop':>6} {'wire MB':>8} {'routed MB':>9} {'ovfl':>6}"
    )
    for r in rows:
        mode = f"{r['dispatch']}:{r['capacity_factor']}"
        if exchanges_tokens(r["dispatch"]):
            mode += f"/{r.get('transport', '')}@{r.get('recv_buffer_factor')}"
        if "error" in r:
            print(f"{r['skew']:>4} {mode:<22} {r['error'][:80]}")
            continue
        a2a = sum(v["bytes"] for k, v in r["collectives"].items() if "all-to-all" in k) / 1e6
        wire = r.get("pft_wire_bytes_per_device", 0) + r.get("rbd_node_wire_bytes_per_device", 0)
        wire = wire / 1e6 if exchanges_tokens(r["dispatch"]) else a2a
        routed = r.get("routed_bytes_per_device", 0) / 1e6
        print(
            f"{r['skew']:>4} {mode:<22} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>8.2f} {r['tokens_per_s']:>10.0f} "
            f"{r['useful_tflops_per_device']:>8.1f} {(r['temp_bytes'] or 0) / 1e9:>8.2f} {r['drop_rate']:>6.3f} "
            f"{wire:>8.1f} {routed:>9.1f} {r.get('num_overflow', 0):>6}"
        )
    for st in stages:
        if "error" in st:
            print(f"stages {st['dispatch']} skew {st['skew']}: {st['error'][:80]}")
            continue
        parts = "  ".join(f"{r['stage']} {r['stage_ms']:.2f}" for r in st["stages"])
        print(f"stages {st['dispatch']} skew {st['skew']} (fwd ms): {parts}")
        if "stage_fwd_bwd_ms" in st["stages"][0]:
            parts = "  ".join(f"{r['stage']} {r['stage_fwd_bwd_ms']:.2f}" for r in st["stages"])
            print(f"stages {st['dispatch']} skew {st['skew']} (fwd+bwd ms): {parts}")
    for c in crossing:
        saving = 1 - c["rbd_node_rows"] / max(c["pft_node_rows"], 1)
        print(
            f"node rows skew {c['skew']} ({c['nodes']} nodes x {c['gpus_per_node']}): pft {c['pft_node_rows']} "
            f"rbd {c['rbd_node_rows']} saving {100 * saving:.1f}%"
        )
    for e in exchanges:
        print("exchange", json.dumps(e))
    print(f"dense matmul (same run): {result['dense_matmul_tflops']:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
