"""Every dispatch mode equals the dense oracle: the dispatcher table x layouts, values, gradients
and statistics, on 8 fake CPU devices (tests/conftest.py).

Cases come from the table itself (`moe.dispatchers.DISPATCHERS`): every mode runs every `COMMON`
layout plus its own `MODE_LAYOUTS`, so a mode added to the table is picked up here, and one
missing from `MODE_LAYOUTS` fails (`test_every_dispatch_mode_has_layouts`).

The oracle runs the whole batch on one device: `router.route` + `dense.dense_dispatch` with
gate = weight * keep, where keep is decided independently in NumPy (`reference.keep_ref`) on the
mode's capacity shards: the whole batch for a partitioner mode, each token shard (data x expert,
x tensor under SSMB) for a shard_map mode (the table's `shard_map`), as X-MoE decides drops per
source shard. Per case (`test_dispatch_equals_dense_oracle`):
  - y, dL/dx and every parameter gradient: relative error (norm and max-abs) < 1e-5;
  - the loss to 1e-5 of its terms, the balance and z losses (rtol 1e-5);
  - tokens per expert, copies dropped (== keep_ref's, == sum of max(count - C, 0) per shard,
    and > 0 for a dropping layout) and the drop rate, exactly;
  - experts that keep no copy get exactly zero gradient; a skewed layout's loads really are uneven;
  - on a mesh, the output split over the token axes, over tensor exactly under SSMB with TP > 1;
  - modes that exchange tokens: no overflow and the rows each device received, exactly;
    pft's emulated wire bytes and rbd's pilots (`MODE_CHECKS`).

T=64 tokens, D=16, F=16, float32. One module-scoped cache holds the compiled functions: one
oracle per MoE config, one layer per (config, parallel config, mesh).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import keep_ref, moe_ref, rel_err

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer, router
from xmoe_jax.moe.dense import dense_dispatch
from xmoe_jax.moe.dispatchers import DISPATCHERS
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.sharding import make_mesh

T, D, F, S = 64, 16, 16, 16  # S: tokens per sequence (sequence-wise balance loss)
TOL = 1e-5

_A = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, num_shared_experts=1, shared_expert_gate=True)
CFGS = {
    # swiglu, softmax top-k, gated shared expert
    "A": _A,
    "A-seq": dataclasses.replace(_A, aux_loss_type="sequence"),
    # gelu, DeepSeek-V3 sigmoid with groups and scaling, no shared expert
    "B": MoEConfig(
        num_experts=16, top_k=4, expert_hidden=F, activation="gelu", score_func="sigmoid",
        num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
    ),
    # swiglu sigmoid groups, two gated shared experts
    "G": MoEConfig(
        num_experts=8, top_k=3, expert_hidden=F, score_func="sigmoid", num_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, num_shared_experts=2, shared_expert_gate=True,
    ),
    # gelu sigmoid groups, unnormalised weights, one wider gated shared expert
    "Q": MoEConfig(
        num_experts=16, top_k=4, expert_hidden=F, activation="gelu", score_func="sigmoid", num_groups=4,
        topk_groups=3, norm_topk_prob=False, num_shared_experts=1, shared_expert_hidden=24,
        shared_expert_gate=True,
    ),
    "S": MoEConfig(num_experts=8, top_k=2, expert_hidden=F, score_func="sigmoid"),
    "K4": MoEConfig(num_experts=16, top_k=4, expert_hidden=F),
    "K6": MoEConfig(num_experts=16, top_k=6, expert_hidden=F),
    # node-limited routing: groups are expert nodes (parallel.route_groups_by_node)
    "N2-1": MoEConfig(num_experts=16, top_k=4, expert_hidden=F, score_func="sigmoid", num_groups=2, topk_groups=1),
    "N4-2": MoEConfig(num_experts=16, top_k=6, expert_hidden=F, score_func="sigmoid", num_groups=4, topk_groups=2),
    "N4-2-E32": MoEConfig(
        num_experts=32, top_k=6, expert_hidden=F, score_func="sigmoid", num_groups=4, topk_groups=2
    ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where and how one case runs: mesh (data, expert, tensor, expert_nodes) or None (one device),
    the MoE config, capacity (factor, drop policy) or None (dropless), uneven routing, and
    ParallelConfig overrides besides the dispatch mode."""

    name: str
    mesh: tuple[int, int, int, int] | None
    cfg: str = "A"
    capacity: tuple[float, str] | None = None
    skew: bool = False  # some experts crowded, some empty, some devices receive nothing
    parallel: tuple[tuple[str, object], ...] = ()
    slow: bool = False  # a variant whose feature another default case covers: CI's slow run takes it

    @property
    def tensor(self) -> int:
        return self.mesh[2] if self.mesh else 1


SSMB = (("ssmb", True),)

# every dispatch mode runs these: one device, data x expert, dropping, tensor replicated / SSMB
COMMON = [
    Layout("one-device", None),
    Layout("one-device-cf0.5-probs", None, capacity=(0.5, "probs"), skew=True),
    Layout("dp2-ep4-cf1.0-position", (2, 4, 1, 1), capacity=(1.0, "position"), skew=True),
    Layout("ep8-B", (1, 8, 1, 1), cfg="B"),
    Layout("dp2-ep2-tp2", (2, 2, 2, 1)),  # tokens replicated over tensor
    Layout("dp2-ep2-tp2-ssmb-cf1.0-probs", (2, 2, 2, 1), capacity=(1.0, "probs"), skew=True, parallel=SSMB),
]

# each mode's own layouts; a mode of the table without an entry here fails
MODE_LAYOUTS: dict[str, list[Layout]] = {
    "dense": [
        Layout("dp2-ep4", (2, 4, 1, 1)),
        Layout("dp4-ep2-cf1.0-probs", (4, 2, 1, 1), capacity=(1.0, "probs"), skew=True),
        Layout("dp2-ep4-B-cf1.0-position", (2, 4, 1, 1), cfg="B", capacity=(1.0, "position"), skew=True),
    ],
    "padded": [
        Layout("one-device-cf0.5-position", None, capacity=(0.5, "position"), skew=True),
        Layout("one-device-cf1.0-probs", None, capacity=(1.0, "probs"), skew=True),
        Layout("one-device-cf1.0-position", None, capacity=(1.0, "position"), skew=True),
        Layout("one-device-G", None, cfg="G", skew=True),
        Layout("one-device-Q-cf1.0-position", None, cfg="Q", capacity=(1.0, "position"), skew=True),
        Layout("dp8-cf0.5-probs", (8, 1, 1, 1), capacity=(0.5, "probs"), skew=True),
        Layout("dp4-ep2", (4, 2, 1, 1), skew=True),
        Layout("dp2-ep2-tp2-cf1.0-probs", (2, 2, 2, 1), capacity=(1.0, "probs"), skew=True),
        Layout("dp2-ep2-tp2-ssmb", (2, 2, 2, 1), parallel=SSMB),  # the SSMB token annotation
        Layout("dp2-ep4-B", (2, 4, 1, 1), cfg="B", skew=True),
    ],
    "pft": [
        Layout("dp2-ep4", (2, 4, 1, 1), skew=True),
        Layout("ep8", (1, 8, 1, 1)),  # one expert per device
        Layout("dp4-ep2", (4, 2, 1, 1)),
        Layout("dp8-no-exchange", (8, 1, 1, 1)),
        Layout("dp2-ep4-B", (2, 4, 1, 1), cfg="B", slow=True),
        Layout("dp2-ep4-ssmb-tp1", (2, 4, 1, 1), parallel=SSMB),  # SSMB is a no-op at TP=1
        Layout("dp2-ep2-tp2-ssmb", (2, 2, 2, 1), parallel=SSMB),
        Layout("ep2-tp4", (1, 2, 4, 1)),
        Layout("ep2-tp4-ssmb", (1, 2, 4, 1), parallel=SSMB, slow=True),
        Layout("dp2-tp4-ssmb", (2, 1, 4, 1), parallel=SSMB),  # no expert parallelism: 8 tokens/device
        Layout("dp2-tp4-ssmb-sequence-loss", (2, 1, 4, 1), cfg="A-seq", parallel=SSMB),  # sequences cut by TP
        Layout("ep2-tp4-expert-tp", (1, 2, 4, 1), parallel=(("expert_tensor_parallel", True),)),
        Layout("dp2-ep2-tp2-auto-shard-ssmb", (2, 2, 2, 1), parallel=(("auto_shard", True), *SSMB)),
        Layout("dp2-ep4-bucketed", (2, 4, 1, 1), parallel=(("transport", "bucketed"),)),
        # the exact transport's split plan through XLA:CPU's emulation of ragged_all_to_all
        Layout("dp2-ep4-exact", (2, 4, 1, 1), parallel=(("transport", "exact"),), skew=True),
        # the push kernel's plan (one update per peer) through its XLA reference (kernels/push/xla.py)
        Layout("dp2-ep4-push", (2, 4, 1, 1), parallel=(("transport", "push"),), skew=True),
        Layout(
            "dp2-ep4-bucketed-2chunks", (2, 4, 1, 1), parallel=(("transport", "bucketed"), ("overlap_chunks", 2))
        ),
        Layout(
            "dp2-ep4-emulated-4chunks", (2, 4, 1, 1), parallel=(("transport", "emulated"), ("overlap_chunks", 4)),
            slow=True,
        ),
        Layout("dp2-ep4-S-cf0.75-probs", (2, 4, 1, 1), cfg="S", capacity=(0.75, "probs"), skew=True),
        Layout("dp2-ep4-S-cf0.75-position", (2, 4, 1, 1), cfg="S", capacity=(0.75, "position"), skew=True, slow=True),
    ],
    "rbd": [  # expert = expert_nodes x devices per node: nodes of 2 and 4; 1, 2, 4 experts per device
        # (COMMON runs rbd on one node: pft inside it)
        Layout("dp2-ep4-nodes2", (2, 4, 1, 2), skew=True),
        Layout("ep8-nodes2", (1, 8, 1, 2), skew=True, slow=True),
        Layout("ep8-nodes4-K4", (1, 8, 1, 4), cfg="K4", skew=True, slow=True),
        Layout("dp2-ep4-nodes2-K6", (2, 4, 1, 2), cfg="K6", skew=True, slow=True),
        Layout("dp2-ep4-nodes4-K4", (2, 4, 1, 4), cfg="K4", skew=True),  # single-device nodes
        Layout("ep8-nodes2-limit1", (1, 8, 1, 2), cfg="N2-1", skew=True, parallel=(("route_groups_by_node", True),), slow=True),
        Layout("dp2-ep4-nodes4-limit2", (2, 4, 1, 4), cfg="N4-2", skew=True, parallel=(("route_groups_by_node", True),)),
        Layout("ep8-nodes4-limit2-E32", (1, 8, 1, 4), cfg="N4-2-E32", skew=True, parallel=(("route_groups_by_node", True),), slow=True),
        Layout("ep4-tp2-nodes2-ssmb", (1, 4, 2, 2), parallel=SSMB),
        Layout("ep2-tp4-nodes2-ssmb", (1, 2, 4, 2), parallel=SSMB, slow=True),
        Layout("dp2-ep2-tp2-nodes2", (2, 2, 2, 2)),  # tokens replicated over tensor
        Layout("dp2-ep4-nodes2-exact", (2, 4, 1, 2), skew=True, parallel=(("transport", "exact"),)),  # both stages
        # push inside the node, the padded all_to_all across nodes (its record's across_nodes)
        Layout("dp2-ep4-nodes2-push", (2, 4, 1, 2), skew=True, parallel=(("transport", "push"),)),
        Layout("ep8-nodes2-K4-buffer3", (1, 8, 1, 2), cfg="K4", parallel=(("recv_buffer_factor", 3.0),)),
        Layout("dp2-ep4-nodes2-S-cf0.75-probs", (2, 4, 1, 2), cfg="S", capacity=(0.75, "probs"), skew=True),
        Layout("dp2-ep4-nodes2-S-cf0.75-position", (2, 4, 1, 2), cfg="S", capacity=(0.75, "position"), skew=True, slow=True),
    ],
}  # fmt: skip


def _cases():
    for mode in sorted(DISPATCHERS):
        if mode not in MODE_LAYOUTS:
            yield pytest.param(mode, None, id=f"{mode}-NO-LAYOUT")
            continue
        for layout in COMMON + MODE_LAYOUTS[mode]:
            marks = [pytest.mark.slow] if layout.slow else []
            yield pytest.param(mode, layout, id=f"{mode}-{layout.name}", marks=marks)


# ----------------------------------------------------------------------------- inputs and compiled functions


def _cfg(layout: Layout) -> MoEConfig:
    cfg = CFGS[layout.cfg]
    if layout.capacity is None:
        return cfg
    factor, policy = layout.capacity
    return dataclasses.replace(cfg, capacity_factor=factor, drop_policy=policy)


def _params(cfg: MoEConfig, skew: bool) -> dict:
    params = init_moe_params(jax.random.key(1), D, cfg, std=0.2)
    if "bias" in params["router"]:
        params["router"]["bias"] = 0.1 * jax.random.normal(jax.random.key(101), (cfg.num_experts,))
    if skew:  # inputs have mean +1 per feature: experts 0 and 2 crowded, 1 and 3 empty
        off_E = np.zeros(cfg.num_experts, np.float32)
        off_E[[0, 2]], off_E[[1, 3]] = 0.15, -1.0
        params["router"]["kernel"] = params["router"]["kernel"] + off_E[None, :]
        if "bias" in params["router"]:  # saturated sigmoid scores: let the selection bias agree
            params["router"]["bias"] = params["router"]["bias"] + off_E
    return params


def _x(skew: bool) -> jax.Array:
    return jax.random.normal(jax.random.key(0), (T, D), jnp.float32) + (1.0 if skew else 0.0)


def _proj() -> jax.Array:
    return jax.random.normal(jax.random.key(7), (T, D), jnp.float32)


def _oracle_fn(cfg: MoEConfig):
    """Dense oracle of the whole batch on one device with an explicit [T, K] keep mask."""

    def loss(p, x, proj, keep_TK):
        bias = p["router"].get("bias") if cfg.has_router_bias else None
        r = router.route(x, p["router"]["kernel"], bias, cfg)
        y = dense_dispatch(
            x, r.topk_idx_TK, r.topk_weight_TK * keep_TK, p["experts"], cfg.activation, lambda a, _: a
        )
        if cfg.num_shared_experts:
            y = y + shared_experts(x, p["shared"], cfg.activation)
        aux_loss = router.load_balance_loss(r.scores_TE, r.topk_idx_TK, cfg, S)
        z = router.z_loss(r.logits_TE)
        return jnp.sum(y * proj) + aux_loss + 0.1 * z, (y, aux_loss, z, r.topk_idx_TK, r.topk_weight_TK)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _layer_fn(cfg: MoEConfig, par: ParallelConfig, mesh_shape: tuple | None):
    mesh = None
    if mesh_shape is not None:
        data, expert, tensor, nodes = mesh_shape
        mesh = make_mesh(MeshConfig(data=data, expert=expert, tensor=tensor, expert_nodes=nodes))

    def loss(p, x, proj):
        y, aux = moe_layer(p, x, cfg, par, mesh=mesh, seq_len=S)
        return jnp.sum(y * proj) + aux.aux_loss + 0.1 * aux.z_loss, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def compiled() -> Callable:
    """`compiled(kind, *key)`: the module's compiled oracle / layer functions, built once each."""
    builders = {"oracle": _oracle_fn, "layer": _layer_fn}
    return functools.cache(lambda kind, *key: builders[kind](*key))


# ----------------------------------------------------------------------------- independent expectations


def _token_shards(mode: str, par: ParallelConfig, layout: Layout) -> tuple[int, int, int, int]:
    """(data, expert, tensor) shards of the tokens where capacity is decided, and the expert ranks
    exchanging them: a shard_map mode decides per device (tensor counts under SSMB only)."""
    if layout.mesh is None or not DISPATCHERS[mode].shard_map or par.auto_shard:
        return 1, 1, 1, 1
    data, expert, tensor, _ = layout.mesh
    return data, expert, tensor if par.ssmb else 1, expert


def _keep(idx_TK, wts_TK, cfg: MoEConfig, shards: tuple) -> np.ndarray:
    num = int(np.prod(shards[:3]))
    t_loc = T // num
    cap = cfg.capacity(t_loc) if cfg.capacity_factor is not None else None
    return np.concatenate(
        [
            keep_ref(idx_TK[s * t_loc : (s + 1) * t_loc], wts_TK[s * t_loc : (s + 1) * t_loc], cfg.num_experts, cap, cfg.drop_policy)
            for s in range(num)
        ]
    )  # fmt: skip


def _dropped_by_counts(idx_TK, cfg: MoEConfig, shards: tuple) -> int:
    """Copies over capacity, sum over shards of max(count - C, 0): the definition, not keep_ref."""
    if cfg.capacity_factor is None:
        return 0
    num = int(np.prod(shards[:3]))
    t_loc = T // num
    counts_NE = [
        np.bincount(idx_TK[s * t_loc : (s + 1) * t_loc].reshape(-1), minlength=cfg.num_experts)
        for s in range(num)
    ]
    return int(sum(np.maximum(c - cfg.capacity(t_loc), 0).sum() for c in counts_NE))  # fmt: skip


def _recv_rows(idx_TK, keep_TK, cfg: MoEConfig, shards: tuple) -> np.ndarray:
    """Kept copies each device's experts receive, devices in token-shard order (data, expert[, tensor]):
    device (d, r, t) gets the copies of shards (d, *, t) whose expert is one of rank r's."""
    data, expert, tensor, _ = shards
    local_e = cfg.num_experts // expert
    dest_DRTC = (idx_TK // local_e).reshape(data, expert, tensor, -1)
    kept_DRTC = keep_TK.reshape(data, expert, tensor, -1)
    return np.stack([((dest_DRTC == r) & kept_DRTC).sum(axis=(1, 3)) for r in range(expert)], 1).reshape(-1)


def _pft_checks(aux, cfg: MoEConfig, par: ParallelConfig, layout: Layout, shards, idx_TK, keep_TK) -> None:
    """The emulated transport pads every peer chunk to T_local * min(K, L) rows, both directions."""
    data, expert, tensor, _ = shards
    if par.transport not in ("auto", "emulated"):
        return
    t_loc = T // (data * expert * tensor)
    want = 2 * (expert - 1) * t_loc * min(cfg.top_k, cfg.num_experts // expert) * D * 4
    np.testing.assert_array_equal(np.asarray(aux.wire_bytes).reshape(-1), want)


def _rbd_checks(aux, cfg: MoEConfig, par: ParallelConfig, layout: Layout, shards, idx_TK, keep_TK) -> None:
    """One pilot row per distinct (token, destination node), per source device; at most M nodes per
    token with node-limited routing."""
    if layout.mesh is None or shards[1] == 1 or not keep_TK.all():
        return
    nodes = layout.mesh[3]
    data, expert, tensor, _ = shards
    node_NTK = (idx_TK // (cfg.num_experts // nodes)).reshape(data * expert * tensor, -1, cfg.top_k)
    nodes_NT = np.asarray([[len(set(row)) for row in shard] for shard in node_NTK])
    np.testing.assert_array_equal(np.asarray(aux.pilot_rows).reshape(-1), nodes_NT.sum(1))
    own_N = (np.arange(data * expert * tensor) // tensor % expert) // (expert // nodes)
    inter_N = [sum(len(set(row) - {own_N[n]}) for row in shard) for n, shard in enumerate(node_NTK)]
    np.testing.assert_array_equal(np.asarray(aux.inter_node_rows).reshape(-1), inter_N)
    if par.route_groups_by_node:
        assert nodes_NT.max() <= cfg.topk_groups
        assert (np.asarray(aux.pilot_rows) <= cfg.topk_groups * nodes_NT.shape[1]).all()
        assert int(np.max(aux.max_nodes_per_token)) == nodes_NT.max()


MODE_CHECKS = {"pft": _pft_checks, "rbd": _rbd_checks}  # optional: statistics only one mode reports


def _max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def _close(a, b, what: str) -> None:
    assert rel_err(a, b) < TOL, what
    assert _max_rel(a, b) < TOL, what


# ----------------------------------------------------------------------------- the suite


def test_every_dispatch_mode_has_layouts():
    missing = sorted(set(DISPATCHERS) - set(MODE_LAYOUTS))
    assert not missing, (
        f"dispatch mode(s) {missing} of moe/dispatchers.py have no entry in "
        "tests/test_dispatch_oracle.py MODE_LAYOUTS; add the layouts that exercise them"
    )
    assert not set(MODE_LAYOUTS) - set(DISPATCHERS), "MODE_LAYOUTS names a mode the table does not have"


@pytest.mark.slow  # ~28 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_oracle_matches_loop_reference(compiled):
    """The mask oracle itself: with an all-ones mask it is the NumPy loop reference."""
    for name in ("A", "B", "G", "Q"):
        cfg = CFGS[name]
        params, x = _params(cfg, skew=False), _x(skew=False)
        (_, (y, *_)), _ = compiled("oracle", cfg)(params, x, _proj(), jnp.ones((T, cfg.top_k)))
        want, _ = moe_ref(jax.device_get(params), np.asarray(x), cfg)
        assert rel_err(y, want) < TOL, name


@pytest.mark.parametrize("mode, layout", list(_cases()))
def test_dispatch_equals_dense_oracle(compiled, mode: str, layout: Layout | None) -> None:
    if layout is None:
        pytest.fail(
            f"dispatch mode {mode!r} has no layouts: add it to MODE_LAYOUTS in tests/test_dispatch_oracle.py"
        )
    cfg = _cfg(layout)
    par = ParallelConfig(dispatch=mode, **dict(layout.parallel))
    params, x, proj = _params(cfg, layout.skew), _x(layout.skew), _proj()
    oracle = compiled("oracle", dataclasses.replace(cfg, capacity_factor=None))
    (_, (*_, idx, wts)), _ = oracle(params, x, proj, jnp.ones((T, cfg.top_k)))
    idx_TK, wts_TK = np.asarray(idx), np.asarray(wts)
    shards = _token_shards(mode, par, layout)
    keep_TK = _keep(idx_TK, wts_TK, cfg, shards)

    (loss, (y, aux)), (g_p, g_x) = compiled("layer", cfg, par, layout.mesh)(params, x, proj)
    (loss_o, (y_o, aux_loss_o, z_o, _, _)), (go_p, go_x) = oracle(
        params, x, proj, jnp.asarray(keep_TK, jnp.float32)
    )

    # values and gradients
    _close(y, y_o, "y")
    _close(g_x, go_x, "dL/dx")
    assert jax.tree.structure(g_p) == jax.tree.structure(go_p)
    for (path, g), g_o in zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree.leaves(go_p), strict=True):
        _close(g, g_o, jax.tree_util.keystr(path))
    # the loss is a sum with cancellation: compare against the size of its terms
    assert abs(float(loss) - float(loss_o)) < TOL * float(jnp.sum(jnp.abs(y_o * proj)))
    np.testing.assert_allclose(float(aux.aux_loss), float(aux_loss_o), rtol=TOL)
    np.testing.assert_allclose(float(aux.z_loss), float(z_o), rtol=TOL)

    # routing statistics, exactly
    counts_E = np.bincount(idx_TK.reshape(-1), minlength=cfg.num_experts)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts_E)
    num_dropped = int((~keep_TK).sum())
    assert int(aux.num_dropped) == num_dropped == _dropped_by_counts(idx_TK, cfg, shards)
    assert (num_dropped > 0) == (layout.capacity is not None), num_dropped
    assert float(aux.drop_rate) == np.float32(num_dropped) / np.float32(T * cfg.top_k)
    if layout.capacity is not None and int(np.prod(shards[:3])) > 1:  # capacity per source shard matters
        whole = keep_ref(idx_TK, wts_TK, cfg.num_experts, cfg.capacity(T), cfg.drop_policy)
        assert (whole != keep_TK).any()
    if layout.skew:
        assert counts_E.max() >= 2 * T * cfg.top_k / cfg.num_experts and counts_E.min() == 0, counts_E
    kept_E = np.bincount(idx_TK[keep_TK], minlength=cfg.num_experts)
    for key, g in g_p["experts"].items():  # experts that keep no copy: exactly zero gradient
        assert float(np.abs(np.asarray(g)[kept_E == 0]).max(initial=0.0)) == 0.0, key

    # placement: the output stays on the token axes, over tensor exactly under SSMB with TP > 1
    if layout.mesh is not None:
        spec0 = y.sharding.spec[0] if y.sharding.spec else None
        assert spec0 is not None
        tensor_split = "tensor" in (spec0 if isinstance(spec0, tuple) else (spec0,))
        assert tensor_split == (par.ssmb and layout.tensor > 1)

    # the exchange: worst-case buffers never overflow; each device's received rows
    if DISPATCHERS[mode].exchanges_tokens:
        assert int(aux.num_overflow) == 0
        recv = np.asarray(aux.recv_rows).reshape(-1)
        np.testing.assert_array_equal(recv, _recv_rows(idx_TK, keep_TK, cfg, shards))
        assert recv.sum() == T * cfg.top_k - num_dropped
    if mode in MODE_CHECKS:
        MODE_CHECKS[mode](aux, cfg, par, layout, shards, idx_TK, keep_TK)
