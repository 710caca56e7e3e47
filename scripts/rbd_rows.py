"""RBD inter-node traffic: cost-model predictions and rows measured on simulated layouts.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/rbd_rows.py --out rows.json

1. The cost model (xmoe_jax/perf/rbd_cost.py) for the paper's Large and Super configs (E=256, k=8,
   8 GPUs per node) at EP 16..256, uniform routing: rows per token with and without RBD, saving.
2. On the local devices (fake CPU devices work), a Small-shaped MoE layer (E=64, k=6) with
   expert parallelism over all devices factored into nodes of 2 and of 4: the pilot rows and
   inter-node rows RBD really sends (its aux statistics) against the rows PFT sends across
   nodes for the same routing, uniform and skewed.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import moe_layer
from xmoe_jax.perf.moe_bench import make_inputs
from xmoe_jax.perf.rbd_cost import expected_distinct_nodes, uniform_saving
from xmoe_jax.perf.timing import environment
from xmoe_jax.sharding import make_mesh


def cost_table() -> list[dict]:
    rows = []
    for name in ("large", "super"):  # both E=256, k=8 (docs/design.md#model-table)
        for ep in (16, 32, 64, 128, 256):
            nodes = ep // 8
            rows.append(
                {
                    "config": name,
                    "ep": ep,
                    "nodes": nodes,
                    "pft_rows_per_token": 8,
                    "rbd_rows_per_token": round(expected_distinct_nodes(256, 8, nodes), 3),
                    "saving": round(uniform_saving(256, 8, nodes), 4),
                }
            )
    return rows


def measured(tokens_per_device: int, skews: list[float], nodes_list: list[int]) -> list[dict]:
    devices = jax.device_count()
    par = ParallelConfig(dispatch="rbd")
    rows = []
    for nodes in nodes_list:
        for skew in skews:
            cfg = MoEConfig(num_experts=64, top_k=6, expert_hidden=64, activation="gelu")
            params, x = make_inputs(cfg, 64, tokens_per_device * devices, skew, jax.numpy.float32)
            mesh = make_mesh(MeshConfig(data=1, expert=devices, expert_nodes=nodes))
            _, stats = jax.jit(lambda p, x, m=mesh, c=cfg: moe_layer(p, x, c, par, mesh=m))(params, x)
            # what pft would send across nodes for the same routing: copies whose expert is off-node
            logits = np.asarray(x @ params["router"]["kernel"])
            idx = np.argsort(-logits, axis=-1)[:, :6]
            node_of_expert = idx // (64 // nodes)
            src_node = (np.arange(idx.shape[0]) // tokens_per_device) // (devices // nodes)
            pft_inter = int((node_of_expert != src_node[:, None]).sum())
            rbd_inter = int(np.asarray(stats.inter_node_rows).sum())
            rows.append(
                {
                    "nodes": nodes,
                    "gpus_per_node": devices // nodes,
                    "skew": skew,
                    "tokens": int(idx.shape[0]),
                    "pft_inter_node_rows": pft_inter,
                    "rbd_inter_node_rows": rbd_inter,
                    "rbd_pilot_rows": int(np.asarray(stats.pilot_rows).sum()),
                    "saving": round(1 - rbd_inter / max(pft_inter, 1), 4),
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-device", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {
        **environment(),
        "cost_model": cost_table(),
        "measured": measured(args.tokens_per_device, [0.0, 1.0], [2, 4]),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("cost model (uniform routing, E=256, k=8, 8 GPUs/node)")
    for r in result["cost_model"]:
        print(
            f"  {r['config']:<6} EP{r['ep']:<4} nodes {r['nodes']:<3} rows/token pft 8 rbd "
            f"{r['rbd_rows_per_token']:.2f}  saving {100 * r['saving']:.1f}%"
        )
    print(f"measured inter-node rows ({result['device']} x {result['num_devices']})")
    for r in result["measured"]:
        print(
            f"  nodes {r['nodes']} x {r['gpus_per_node']}  skew {r['skew']}: pft {r['pft_inter_node_rows']}  "
            f"rbd {r['rbd_inter_node_rows']}  saving {100 * r['saving']:.1f}%"
        )


if __name__ == "__main__":
    main()
