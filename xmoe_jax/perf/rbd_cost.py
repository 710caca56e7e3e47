"""RBD cost model: rows that cross the node axis with and without redundancy bypassing.

Without RBD every routed copy whose expert lives on another node crosses the node
axis. With RBD one pilot per (token, destination node) crosses instead, so the rows
per token fall from K to the number of distinct nodes among its K experts.
Saving = 1 - E[#distinct nodes] / K (docs/design.md#rbd).

Under uniform routing (K distinct experts drawn without replacement from E, E/N
per node), node n is hit unless all K picks avoid it:
    E[#distinct nodes] = N * (1 - C(E - E/N, K) / C(E, K)).

Node-limited routing (DeepSeek-V3; `parallel.route_groups_by_node`: the router keeps M =
topk_groups groups per token and group g is node g) caps the rows per token at M, whatever the
routing: rows <= min(K, M) per token. Uniform within the M chosen nodes (K experts drawn from
their M*E/N):
    E[#distinct nodes] = M * (1 - C(M*E/N - E/N, K) / C(M*E/N, K)) <= M.
"""

from __future__ import annotations

from math import comb

import numpy as np


def expected_distinct_nodes(num_experts: int, top_k: int, num_nodes: int) -> float:
    per_node = num_experts // num_nodes
    return num_nodes * (1 - comb(num_experts - per_node, top_k) / comb(num_experts, top_k))


def node_limited_distinct_nodes(num_experts: int, top_k: int, num_nodes: int, max_nodes: int) -> float:
    """E[#distinct nodes] of a token whose K experts are uniform over M = max_nodes nodes (<= M)."""
    return expected_distinct_nodes(num_experts * max_nodes // num_nodes, top_k, max_nodes)


def uniform_saving(num_experts: int, top_k: int, num_nodes: int) -> float:
    """Fraction of per-token rows RBD removes under uniform routing."""
    return 1 - expected_distinct_nodes(num_experts, top_k, num_nodes) / top_k


def predict(
    num_experts: int, top_k: int, num_nodes: int, tokens: int, topk_idx_TK=None, max_nodes: int | None = None
) -> dict:
    """Rows across the node axis without (pft) and with (rbd) redundancy bypassing.

    With `topk_idx_TK` (measured routing, experts numbered node-major) the counts are
    exact for those tokens, all sent from node 0's point of view averaged over source
    nodes; without it, uniform routing and `tokens` tokens per node are assumed.
    Counts include rows to the sender's own node under `*_rows` and exclude them
    under `*_inter_node` (the rows that really cross). `max_nodes`: node-limited routing's M
    (uniform routing within M nodes; measured routing is what it is). `max_rows_per_token`: the
    most rows one token sends (measured), or the bound min(K, N, M).
    """
    per_node = num_experts // num_nodes
    off_node = (num_nodes - 1) / num_nodes
    bound = min(top_k, num_nodes, max_nodes or num_nodes)
    if topk_idx_TK is None:
        if max_nodes is None:
            distinct = expected_distinct_nodes(num_experts, top_k, num_nodes)
        else:
            distinct = node_limited_distinct_nodes(num_experts, top_k, num_nodes, max_nodes)
        pft_rows, rbd_rows = tokens * top_k, tokens * distinct
    else:
        node_TK = np.asarray(topk_idx_TK) // per_node
        hits_TN = np.zeros((node_TK.shape[0], num_nodes), bool)
        np.put_along_axis(hits_TN, node_TK, True, axis=1)
        pft_rows, rbd_rows = float(node_TK.size), float(hits_TN.sum())
        tokens = node_TK.shape[0]
        bound = int(hits_TN.sum(-1).max())
    return {
        "num_nodes": num_nodes,
        "tokens": tokens,
        "pft_rows": pft_rows,
        "rbd_rows": rbd_rows,
        "pft_inter_node": pft_rows * off_node,
        "rbd_inter_node": rbd_rows * off_node,
        "saving": 1 - rbd_rows / pft_rows,
        "max_rows_per_token": bound,
    }
