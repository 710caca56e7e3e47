"""Manual (pft + SSMB in shard_map) vs automatic (XLA partitioner) sharding of the MoE layer.

    # 8 fake CPU devices: compile-time columns only (memory, collectives)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/compare_sharding.py \\
        --config configs/small.yaml --set mesh.expert=4 --set mesh.tensor=2 --tokens 4096 --out cmp.json
    # 2 GPUs: adds the step time
    python scripts/compare_sharding.py --config configs/small.yaml --set mesh.expert=1 \\
        --set mesh.tensor=2 --tokens 16384 --model-layers 2 --out cmp_h200.json

For the config's MoE layer (model.hidden, model.moe) and mesh (mesh.*), compiles every
variant (xmoe_jax/perf/compare.py: pft+ssmb, pft, pft+etp, pft-auto, padded-auto) as one
layer's forward+backward, optionally also a whole model with --model-layers N, and prints
one JSON line per row, then the compact table last. --out writes the rows and the
environment as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from xmoe_jax.launch.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from xmoe_jax.config import load_config  # noqa: E402
from xmoe_jax.perf import compare  # noqa: E402
from xmoe_jax.perf.timing import environment  # noqa: E402
from xmoe_jax.sharding import make_mesh, mesh_shape  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--tokens", type=int, default=None, help="tokens per layer call (default batch*seq_len)")
    p.add_argument(
        "--variants", default=",".join(compare.DEFAULT_VARIANTS), help=f"from {list(compare.VARIANTS)}"
    )
    p.add_argument("--model-layers", type=int, default=0, help="also compile a model of N MoE layers")
    p.add_argument("--sequence-parallel", action="store_true", help="model rows: residual split over tensor")
    p.add_argument("--dtype", default=None, help="layer dtype (default: model.dtype on GPU, float32 on CPU)")
    p.add_argument(
        "--time", dest="time", action="store_true", default=None, help="time steps (default on GPU)"
    )
    p.add_argument("--no-time", dest="time", action="store_false")
    p.add_argument("--out", default=None, help="write rows + environment as JSON")
    args = p.parse_args()

    cfg = load_config(args.config, args.set)
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or (cfg.model.dtype if on_gpu else "float32"))
    time_it = on_gpu if args.time is None else args.time
    num_tokens = args.tokens or cfg.train.batch_size * cfg.train.seq_len
    mesh = make_mesh(cfg.mesh)
    model_cfg, batch, seq_len = None, None, None
    if args.model_layers:  # sequences of train.seq_len, halved until the batch splits over data x expert
        seq_len, shards = min(cfg.train.seq_len, num_tokens), mesh_shape(mesh).batch_shards
        while (num_tokens // seq_len) % shards and seq_len > 1:
            seq_len //= 2
        batch = num_tokens // seq_len
        model_cfg = dataclasses.replace(
            cfg.model, num_layers=args.model_layers, num_dense_layers=0, dtype=dtype.name
        )
    rows = compare.compare(
        cfg.model.moe,
        cfg.model.hidden,
        num_tokens,
        mesh,
        variants=tuple(args.variants.split(",")),
        dtype=dtype,
        time_it=time_it,
        model_cfg=model_cfg,
        batch=batch,
        seq_len=seq_len,
        sequence_parallel=args.sequence_parallel,
        on_row=lambda row: print(json.dumps(compare.jsonable(row)), flush=True),
        parallel=cfg.parallel,
    )
    setup = {
        "config": args.config,
        "overrides": args.set,
        "tokens": num_tokens,
        "mesh": dict(mesh.shape),
        "dtype": dtype.name,
        "model_layers": args.model_layers,
        "model_batch": [batch, seq_len] if args.model_layers else None,
        "sequence_parallel": args.sequence_parallel,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                compare.jsonable({"environment": environment(), "setup": setup, "rows": rows}), f, indent=1
            )
    print(f"\n{setup}\n")
    print(compare.table(rows))


if __name__ == "__main__":
    main()
