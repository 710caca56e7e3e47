"""RBD inter-node traffic: cost-model predictions and rows measured on simulated layouts.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/rbd_rows.py --out rows.json

1. The cost model (xmoe_jax/perf/rbd_cost.py) for the paper's Large and Super configs (E=256, k=8,
   8 GPUs per node) at EP 16..256, uniform routing: rows per token with and without RBD, saving.
2. On the local devices (fake CPU devices work), a Small-shaped MoE layer (E=64, k=6) with
   expert parallelism over all devices factored into nodes of 2 and of 4: the pilot rows and
   inter-node rows RBD really sends (its aux statistics) against the rows PFT sends across
   nodes for the same routing, uniform and skewed.
3. Node-limited routing (DeepSeek-V3; parallel.route_groups_by_node): the cost model for V3
   (E=256, k=8, 8 nodes = 8 groups, M = 1..8 kept), and measured on the local devices with sigmoid
   routing in as many groups as nodes, M kept: the most rows one token sent across the node axis
   (must be <= M), rows per token, and RBD's saving against PFT for the same routing.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import moe_layer
from xmoe_jax.moe.router import route
from xmoe_jax.perf.moe_bench import make_inputs
from xmoe_jax.perf.rbd_cost import expected_distinct_nodes, node_limited_distinct_nodes, uniform_saving
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


def node_limited_table() -> list[dict]:
    """DeepSeek-V3 (E=256, k=8) on 8 nodes, one routing group per node, M groups kept."""
    return [
        {
            "config": "deepseek_v3",
            "nodes": 8,
            "max_nodes": m,
            "pft_rows_per_token": 8,
            "rbd_rows_per_token_bound": min(8, m),
            "rbd_rows_per_token_uniform": round(node_limited_distinct_nodes(256, 8, 8, m), 3),
        }
        for m in (1, 2, 4, 8)
    ]


def _one(cfg: MoEConfig, par: ParallelConfig, nodes: int, tokens_per_device: int, skew: float) -> dict:
    """One layer's routing on the local devices: rows across the node axis, rbd (measured) and pft."""
    devices = jax.device_count()
    params, x = make_inputs(cfg, 64, tokens_per_device * devices, skew, jax.numpy.float32)
    mesh = make_mesh(MeshConfig(data=1, expert=devices, expert_nodes=nodes))
    _, stats = jax.jit(lambda p, x, m=mesh, c=cfg: moe_layer(p, x, c, par, mesh=m))(params, x)
    # the routing itself (selection bias zero): which node each copy goes to
    idx = np.asarray(route(x, params["router"]["kernel"], None, cfg).topk_idx_TK)
    node_of_expert = idx // (cfg.num_experts // nodes)
    src_node = (np.arange(idx.shape[0]) // tokens_per_device) // (devices // nodes)
    pft_inter = int((node_of_expert != src_node[:, None]).sum())  # pft: every off-node copy crosses
    rbd_inter = int(np.asarray(stats.inter_node_rows).sum())
    return {
        "nodes": nodes,
        "gpus_per_node": devices // nodes,
        "skew": skew,
        "tokens": int(idx.shape[0]),
        "pft_inter_node_rows": pft_inter,
        "rbd_inter_node_rows": rbd_inter,
        "rbd_pilot_rows": int(np.asarray(stats.pilot_rows).sum()),
        "rbd_max_rows_per_token": int(np.max(stats.max_nodes_per_token)),
        "saving": round(1 - rbd_inter / max(pft_inter, 1), 4),
    }


def measured(tokens_per_device: int, skews: list[float], nodes_list: list[int]) -> list[dict]:
    cfg = MoEConfig(num_experts=64, top_k=6, expert_hidden=64, activation="gelu")
    par = ParallelConfig(dispatch="rbd")
    return [_one(cfg, par, nodes, tokens_per_device, skew) for nodes in nodes_list for skew in skews]


def measured_node_limited(tokens_per_device: int, nodes_list: list[int]) -> list[dict]:
    """Sigmoid routing in `nodes` groups, M = 1 .. nodes kept, node-limited rbd."""
    par = ParallelConfig(dispatch="rbd", route_groups_by_node=True)
    rows = []
    for nodes in nodes_list:
        for limit in range(1, nodes + 1):
            cfg = MoEConfig(
                num_experts=64, top_k=6, expert_hidden=64, activation="gelu", score_func="sigmoid",
                num_groups=nodes, topk_groups=limit,
            )  # fmt: skip
            row = _one(cfg, par, nodes, tokens_per_device, 0.0)
            rows.append(
                {**row, "max_nodes": limit, "rbd_pilot_rows_per_token": row["rbd_pilot_rows"] / row["tokens"]}
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
        "node_limited_cost_model": node_limited_table(),
        "node_limited_measured": measured_node_limited(args.tokens_per_device, [2, 4]),
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
    print("node-limited routing, cost model (DeepSeek-V3: E=256, k=8, 8 nodes = 8 groups, M kept)")
    for r in result["node_limited_cost_model"]:
        print(
            f"  M={r['max_nodes']}: rows/token pft 8, rbd <= {r['rbd_rows_per_token_bound']} "
            f"(uniform {r['rbd_rows_per_token_uniform']:.2f})"
        )
    print("node-limited routing, measured (E=64, k=6, sigmoid routing, groups = nodes)")
    for r in result["node_limited_measured"]:
        print(
            f"  nodes {r['nodes']} x {r['gpus_per_node']}  M={r['max_nodes']}: most rows one token sent "
            f"{r['rbd_max_rows_per_token']} (<= M: {r['rbd_max_rows_per_token'] <= r['max_nodes']}), pilots/token "
            f"{r['rbd_pilot_rows_per_token']:.2f}; inter-node rows pft {r['pft_inter_node_rows']}  "
            f"rbd {r['rbd_inter_node_rows']}  saving {100 * r['saving']:.1f}%"
        )


if __name__ == "__main__":
    main()
