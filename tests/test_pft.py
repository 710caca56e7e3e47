"""`pft`'s capacity, receive-buffer and skew semantics on fake CPU meshes: values, gradients and
load statistics against the dense oracle with the keep mask pft must apply. (Dropless pft on every
layout against the oracle: tests/test_dispatch_oracle.py, with every other dispatch mode.)

The oracle runs the whole batch without a mesh: `router.route` + `dense.dense_dispatch` with
gate = weight * mask, where mask says which routed copies pft is expected to keep. The mask is
derived independently in NumPy (`_simulate`): capacity per source shard (`keep_ref` on each of
the data*expert contiguous token shards, in the order PartitionSpec(("data", "expert")) shards
dim 0), then each destination device accepts rows in (source, local expert) order, each expert's
copies in queue order, up to M = pft.recv_rows(E, K, T_local, P, C, factor) rows.

T=64 tokens, D=16, F=16, float32. Compiled functions are cached per (config, mesh layout), and
the property test reuses the functions of the dropping and overflow tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import keep_ref, moe_ref, rel_err

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig
from xmoe_jax.moe import init_moe_params, moe_layer, router
from xmoe_jax.moe.dense import dense_dispatch
from xmoe_jax.moe.experts import shared_experts
from xmoe_jax.moe.pft import recv_rows
from xmoe_jax.sharding import make_mesh

T, D, F = 64, 16, 16
TOL = 1e-5

# swiglu, softmax top-k, gated shared expert
CFG_A = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, num_shared_experts=1, shared_expert_gate=True)
# gelu, DeepSeek-V3 sigmoid with groups and scaling, no shared expert
CFG_B = MoEConfig(
    num_experts=16,
    top_k=4,
    expert_hidden=F,
    activation="gelu",
    score_func="sigmoid",
    num_groups=4,
    topk_groups=2,
    routed_scaling_factor=2.5,
)
CFGS = {"A": CFG_A, "B": CFG_B}
PFT = ParallelConfig(dispatch="pft")


def _offsets(num_experts: int, kind: str) -> np.ndarray:
    """Per-expert router-column offsets; inputs have mean +1 per feature, so +c shifts logits by ~16c."""
    off = np.zeros(num_experts, np.float32)
    if kind == "strong":  # everything to the first device's experts of a 4-way expert axis
        n_hot = num_experts // 4
        off[:n_hot], off[n_hot:] = 0.5, -0.5
    elif kind == "moderate":  # experts 0, 2 popular; 1, 3 empty (interleaved with used ones)
        off[[0, 2]], off[[1, 3]] = 0.15, -1.0
    return off


def _params(cfg: MoEConfig, offsets=None, seed: int = 1) -> dict:
    params = init_moe_params(jax.random.key(seed), D, cfg, std=0.2)
    if "bias" in params["router"]:
        params["router"]["bias"] = 0.1 * jax.random.normal(jax.random.key(seed + 100), (cfg.num_experts,))
    if offsets is not None:
        params["router"]["kernel"] = params["router"]["kernel"] + jnp.asarray(offsets)[None, :]
        if "bias" in params["router"]:  # saturated sigmoid scores: let the selection bias agree
            params["router"]["bias"] = params["router"]["bias"] + jnp.asarray(offsets)
    return params


def _x(seed: int = 0, shift: float = 0.0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (T, D), jnp.float32) + shift


def _proj() -> jax.Array:
    return jax.random.normal(jax.random.key(7), (T, D), jnp.float32)


def _oracle_cfg(cfg: MoEConfig) -> MoEConfig:
    return dataclasses.replace(cfg, capacity_factor=None)


@functools.cache
def _mesh(layout: tuple):
    data, expert, tensor = layout
    return make_mesh(MeshConfig(data=data, expert=expert, tensor=tensor))


@functools.cache
def _pft_fn(cfg: MoEConfig, par: ParallelConfig, layout: tuple | None):
    mesh = None if layout is None else _mesh(layout)

    def loss(p, x, proj):
        y, aux = moe_layer(p, x, cfg, par, mesh=mesh)
        return jnp.sum(y * proj) + aux.aux_loss + 0.1 * aux.z_loss, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def _route_fn(cfg: MoEConfig):
    def fn(p, x):
        bias = p["router"].get("bias") if cfg.has_router_bias else None
        r = router.route(x, p["router"]["kernel"], bias, cfg)
        return r.topk_idx_TK, r.topk_weight_TK

    return jax.jit(fn)


@functools.cache
def _oracle_fn(cfg: MoEConfig):
    """Dense oracle of the whole batch with an explicit [T, K] mask on the combine weights."""

    def loss(p, x, proj, mask_TK):
        bias = p["router"].get("bias") if cfg.has_router_bias else None
        r = router.route(x, p["router"]["kernel"], bias, cfg)
        gate_TK = r.topk_weight_TK * mask_TK
        y = dense_dispatch(x, r.topk_idx_TK, gate_TK, p["experts"], cfg.activation, lambda a, _: a)
        if cfg.num_shared_experts:
            y = y + shared_experts(x, p["shared"], cfg.activation)
        aux_loss = router.load_balance_loss(r.scores_TE, r.topk_idx_TK, cfg)
        z = router.z_loss(r.logits_TE)
        return jnp.sum(y * proj) + aux_loss + 0.1 * z, (y, aux_loss, z)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# ----------------------------------------------------------------------------- independent keep / overflow model


def _priority(idx_TK, wts_TK, policy: str) -> list[tuple[int, int]]:
    copies = [(t, k) for t in range(idx_TK.shape[0]) for k in range(idx_TK.shape[1])]
    if policy == "probs":
        copies.sort(key=lambda c: (-float(wts_TK[c]), c[0], c[1]))
    else:
        copies.sort(key=lambda c: (c[1], c[0]))
    return copies


def _simulate(idx_TK, wts_TK, cfg: MoEConfig, par: ParallelConfig, layout: tuple | None):
    """(keep_TK, sent_TK, recv_rows per device in (data, expert) order) for pft on `layout`."""
    data, peers = (1, 1) if layout is None else layout[:2]
    num_shards, num_e = data * peers, cfg.num_experts
    t_loc, local_e = T // num_shards, num_e // peers
    cap = cfg.capacity(t_loc) if cfg.capacity_factor is not None else None
    shards = [slice(s * t_loc, (s + 1) * t_loc) for s in range(num_shards)]
    keep = np.concatenate([keep_ref(idx_TK[s], wts_TK[s], num_e, cap, cfg.drop_policy) for s in shards])
    sent = keep.copy()
    if peers == 1:
        return keep, sent, np.array([keep[s].sum() for s in shards])
    room_per_dest = recv_rows(cfg.num_experts, cfg.top_k, t_loc, peers, cap, par.recv_buffer_factor)
    recv = np.zeros(num_shards, np.int64)
    queues = [_priority(idx_TK[s], wts_TK[s], cfg.drop_policy) for s in shards]
    for g in range(data):
        for q in range(peers):
            room = room_per_dest
            for p in range(peers):
                s = g * peers + p
                for e in range(q * local_e, (q + 1) * local_e):
                    rows = [c for c in queues[s] if idx_TK[shards[s]][c] == e and keep[shards[s]][c]]
                    fits = min(room, len(rows))
                    room -= fits
                    for t, k in rows[fits:]:
                        sent[s * t_loc + t, k] = False
            recv[g * peers + q] = room_per_dest - room
    return keep, sent, recv


# ----------------------------------------------------------------------------- the comparison


def _check(
    cfg: MoEConfig, layout: tuple | None, params: dict, x: jax.Array, par: ParallelConfig = PFT
) -> dict:
    """pft on `layout` == dense oracle (values, grads incl. aux losses, load statistics)."""
    proj = _proj()
    idx, wts = (np.asarray(a) for a in _route_fn(_oracle_cfg(cfg))(params, x))
    keep, sent, recv = _simulate(idx, wts, cfg, par, layout)
    mask = jnp.asarray(keep & sent, jnp.float32)

    (_, (y, aux)), (g_p, g_x) = _pft_fn(cfg, par, layout)(params, x, proj)
    (_, (y_o, aux_loss_o, z_o)), (go_p, go_x) = _oracle_fn(_oracle_cfg(cfg))(params, x, proj, mask)

    assert rel_err(y, y_o) < TOL
    assert rel_err(g_x, go_x) < TOL
    assert jax.tree.structure(g_p) == jax.tree.structure(go_p)
    for path, leaf in jax.tree_util.tree_leaves_with_path(g_p):
        want = functools.reduce(lambda t, k: t[k.key], path, go_p)
        assert rel_err(leaf, want) < TOL, jax.tree_util.keystr(path)

    num_e, top_k = cfg.num_experts, cfg.top_k
    np.testing.assert_array_equal(aux.tokens_per_expert, np.bincount(idx.reshape(-1), minlength=num_e))
    assert int(aux.num_dropped) == int((~keep).sum())
    np.testing.assert_allclose(float(aux.drop_rate), (~keep).sum() / (T * top_k), rtol=1e-6)
    assert int(aux.num_overflow) == int((keep & ~sent).sum())
    np.testing.assert_array_equal(np.asarray(aux.recv_rows).reshape(-1), recv)
    np.testing.assert_allclose(float(aux.aux_loss), float(aux_loss_o), rtol=TOL)
    np.testing.assert_allclose(float(aux.z_loss), float(z_o), rtol=TOL)
    if par.recv_buffer_factor is None:
        assert int(aux.num_overflow) == 0
    # the emulated transport pads every peer chunk to T_local * min(K, L) rows, both directions;
    # push puts exactly the routed rows on the wire
    data, peers = (1, 1) if layout is None else layout[:2]
    t_loc, local_e = T // (data * peers), num_e // peers
    want_bytes = 2 * (peers - 1) * t_loc * min(top_k, local_e) * D * 4
    if par.transport == "push":
        want_bytes = np.asarray(aux.routed_bytes).reshape(-1)
    np.testing.assert_array_equal(np.asarray(aux.wire_bytes).reshape(-1), want_bytes)
    return {"aux": aux, "grads": g_p, "keep": keep, "sent": sent, "idx": idx, "wts": wts}


# ----------------------------------------------------------------------------- the oracle
# (dropless pft on every layout against it: tests/test_dispatch_oracle.py)


def test_oracle_matches_loop_reference() -> None:
    """The mask oracle itself: with an all-ones mask it is the NumPy loop reference."""
    for cfg in (CFG_A, CFG_B):
        params, x = _params(cfg), _x()
        ocfg = _oracle_cfg(cfg)
        (_, (y, _, _)), _ = _oracle_fn(ocfg)(params, x, _proj(), jnp.ones((T, cfg.top_k)))
        want, _ = moe_ref(jax.device_get(params), np.asarray(x), ocfg)
        assert rel_err(y, want) < TOL


# ----------------------------------------------------------------------------- skew: empty experts, idle devices


@pytest.mark.parametrize("name", ["A", "B"])
def test_skewed_routing_empty_experts_and_idle_devices(name: str) -> None:
    cfg = CFGS[name]
    layout = (2, 4, 1)
    params, x = _params(cfg, _offsets(cfg.num_experts, "strong")), _x(shift=1.0)
    out = _check(cfg, layout, params, x)
    hot = cfg.num_experts // 4  # the experts of expert-rank 0
    counts = np.asarray(out["aux"].tokens_per_expert)
    assert counts[:hot].sum() == T * cfg.top_k and counts[hot:].sum() == 0, counts
    recv_GQ = np.asarray(out["aux"].recv_rows).reshape(2, 4)
    np.testing.assert_array_equal(recv_GQ[:, 1:], 0)  # expert ranks 1-3 receive nothing
    np.testing.assert_array_equal(recv_GQ[:, 0], T // 2 * cfg.top_k)
    for key, w in out["grads"]["experts"].items():
        assert float(jnp.abs(w[hot:]).max()) == 0.0, key  # empty experts: exactly zero gradient
        assert bool(jnp.all(jnp.abs(w[:hot]).sum(axis=(1, 2)) > 0)), key


# ----------------------------------------------------------------------------- dropping

DROP_CASES = [
    ("A", 0.5, "probs", (2, 4, 1)),
    ("A", 0.5, "position", (4, 2, 1)),
    ("A", 1.0, "probs", (1, 8, 1)),
    ("A", 1.0, "position", (2, 2, 2)),
    ("A", 0.5, "probs", None),
    ("B", 1.0, "position", (2, 4, 1)),
]


@pytest.mark.parametrize(
    "name, cf, policy, layout", DROP_CASES, ids=[f"{n}-cf{c}-{p}-{m}" for n, c, p, m in DROP_CASES]
)
def test_dropping_equals_dense_with_per_shard_keep_mask(name: str, cf: float, policy: str, layout) -> None:
    cfg = dataclasses.replace(CFGS[name], capacity_factor=cf, drop_policy=policy)
    params, x = _params(cfg, _offsets(cfg.num_experts, "moderate")), _x(shift=1.0)
    out = _check(cfg, layout, params, x)
    assert int(out["aux"].num_dropped) == int((~out["keep"]).sum()) > 0
    # capacity is per source shard: here a whole-batch keep mask would keep other copies
    if layout is not None and layout[0] * layout[1] > 1:
        global_keep = keep_ref(out["idx"], out["wts"], cfg.num_experts, cfg.capacity(T), policy)
        assert (global_keep != out["keep"]).any()


# ----------------------------------------------------------------------------- receive-buffer overflow

OVERFLOW_CASES = [
    ("A", 0.25, "strong", (2, 4, 1), "auto"),
    ("B", 0.5, "moderate", (1, 8, 1), "auto"),  # sigmoid weights near-tie: queue by position
    # expert-major arrival (the push kernel's plan, through its XLA reference on CPU)
    ("A", 0.5, "moderate", (2, 4, 1), "push"),
]


@pytest.mark.parametrize(
    "name, factor, skew, layout, transport",
    OVERFLOW_CASES,
    ids=[f"{n}-f{f}-{s}-{m}-{t}" for n, f, s, m, t in OVERFLOW_CASES],
)
def test_receive_buffer_overflow_is_counted_and_zeroed(
    name: str, factor: float, skew: str, layout, transport: str
) -> None:
    policy = "probs" if name == "A" else "position"
    cfg = dataclasses.replace(CFGS[name], drop_policy=policy)
    par = ParallelConfig(dispatch="pft", recv_buffer_factor=factor, transport=transport)
    params, x = _params(cfg, _offsets(cfg.num_experts, skew)), _x(shift=1.0)
    out = _check(cfg, layout, params, x, par)
    aux = out["aux"]
    t_loc = T // (layout[0] * layout[1])
    m_rows = recv_rows(cfg.num_experts, cfg.top_k, t_loc, layout[1], factor=factor)
    assert m_rows < t_loc * cfg.top_k * layout[1]  # smaller than the worst case
    assert int(aux.num_overflow) > 0 and int(aux.num_dropped) == 0
    assert int(np.asarray(aux.recv_rows).max()) == m_rows
    assert int(np.asarray(aux.recv_rows).sum()) + int(aux.num_overflow) == T * cfg.top_k
    # the same input with the default worst-case buffer: nothing overflows
    out_default = _check(CFGS[name], layout, params, x)
    assert int(out_default["aux"].num_overflow) == 0


# ----------------------------------------------------------------------------- property test

PROPERTY_VARIANTS = [
    (CFG_A, PFT),
    (dataclasses.replace(CFG_A, capacity_factor=0.5), PFT),
    (CFG_A, ParallelConfig(dispatch="pft", recv_buffer_factor=0.25)),
]


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    variant=st.sampled_from(range(len(PROPERTY_VARIANTS))),
    offsets=st.lists(st.sampled_from([-1.0, -0.3, 0.0, 0.15, 0.3]), min_size=8, max_size=8),
    x_seed=st.integers(0, 2**16),
)
def test_random_skew_pft_equals_dense(variant: int, offsets: list, x_seed: int) -> None:
    cfg, par = PROPERTY_VARIANTS[variant]
    params, x = _params(cfg, np.asarray(offsets, np.float32)), _x(x_seed, shift=1.0)
    _check(cfg, (2, 4, 1), params, x, par)


# ----------------------------------------------------------------------------- steps 5-6: experts read and write rows in place


@functools.cache
def _in_place_fns(activation: str, impl: str, grouped: bool = False, weighted: bool = False):
    """jax.value_and_grad of arrival_experts on a hand-made receive buffer, and of a dense one-hot
    reference of the same rows; `impl` is the kernels' backend (pallas: interpret mode, whose
    unwritten output rows are NaN, so a reader of rows nobody owns shows up as NaN). `grouped`:
    the rows arrived grouped by expert (push's expert-major arrival), read with no index.
    `weighted`: each received row's routing weight is folded in (pft at EP > 1)."""
    from xmoe_jax.moe.experts import _act, arrival_experts

    def ours(experts, x_MD, weights_M, arrival_R, gs_L, cot_MD, received_M):
        w = weights_M if weighted else None
        y_MD = arrival_experts(x_MD, None if grouped else arrival_R, experts, gs_L, activation, w)
        return jnp.sum(jnp.where(received_M[:, None], y_MD * cot_MD, 0.0)), y_MD

    def ref(experts, x_MD, weights_M, expert_M, cot_MD, received_M):
        onehot_ML = jax.nn.one_hot(expert_M, experts["w_up"].shape[0]) * received_M[:, None]
        up = jnp.einsum("md,ldf,ml->mf", x_MD, experts["w_up"], onehot_ML, precision="highest")
        gate = None
        if activation == "swiglu":
            gate = jnp.einsum("md,ldf,ml->mf", x_MD, experts["w_gate"], onehot_ML, precision="highest")
        act = _act(gate, up, activation)
        if weighted:
            act = act * jnp.where(received_M, weights_M, 0.0)[:, None]
        y_MD = jnp.einsum("mf,lfd,ml->md", act, experts["w_down"], onehot_ML)
        return jnp.sum(y_MD * cot_MD), y_MD

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
    with pytest.MonkeyPatch.context() as mp:  # the default backend is read while tracing
        mp.setenv("XMOE_KERNELS", impl)
        compiled = jax.jit(grad(ours)).lower(*_in_place_args(activation, grouped)[0]).compile()
    return compiled, jax.jit(grad(ref))


def _in_place_args(activation: str, grouped: bool = False):
    """A receive buffer of M = 40 rows from P = 2 sources for L = 3 local experts (one empty
    segment, one empty expert) with 7 padding rows, segments in (source, expert) order or, with
    `grouped`, in (expert, source) order, and routing weights (NaN on the padding rows, which no
    reader may touch); (ours' args, ref's args)."""
    from xmoe_jax.moe.pft import _arrival_index

    m_rows, cc_PL = 40, np.array([[5, 0, 9], [12, 0, 7]], np.int32)
    seg_start_PL = np.concatenate([[0], np.cumsum(cc_PL.reshape(-1))[:-1]]).reshape(cc_PL.shape)
    if grouped:  # expert l's rows first from source 0, then source 1; experts in order
        seg_start_PL = np.cumsum(cc_PL.sum(0)) - cc_PL.sum(0) + np.cumsum(cc_PL, axis=0) - cc_PL
    expert_M = np.full(m_rows, 0, np.int32)
    received_M = np.zeros(m_rows, bool)
    for (p, e), n in np.ndenumerate(cc_PL):
        expert_M[seg_start_PL[p, e] : seg_start_PL[p, e] + n] = e
        received_M[seg_start_PL[p, e] : seg_start_PL[p, e] + n] = True
    keys = jax.random.split(jax.random.key(3), 5)
    names = ("w_gate", "w_up") if activation == "swiglu" else ("w_up",)
    experts = {n: 0.3 * jax.random.normal(keys[i], (3, D, F)) for i, n in enumerate(names)}
    experts["w_down"] = 0.3 * jax.random.normal(keys[3], (3, F, D))
    x_MD, cot_MD = jax.random.normal(keys[4], (2, m_rows, D))
    weights_M = jnp.where(received_M, jax.random.uniform(keys[2], (m_rows,), minval=0.1, maxval=1.0), jnp.nan)
    arrival_R = _arrival_index(jnp.asarray(cc_PL), jnp.asarray(seg_start_PL), m_rows)
    gs_L = jnp.asarray(cc_PL.sum(0))
    received = jnp.asarray(received_M)
    return (
        (experts, x_MD, weights_M, arrival_R, gs_L, cot_MD, received),
        (experts, x_MD, weights_M, expert_M, cot_MD, received),
    )


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("grouped", [False, True], ids=["source-major", "expert-major"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_experts_read_and_write_received_rows_in_place(
    activation: str, impl: str, grouped: bool, weighted
) -> None:
    """Steps 5-6 with no group / ungroup copy: values on the received rows and gradients (the
    padding rows' input gradient is zero) equal a dense one-hot reference, on XLA and on the
    Pallas kernels: gathered loads and scattered stores for rows in (source, expert) order, plain
    grouped loads and stores for rows that arrived grouped by expert. `weighted` (what pft runs at
    EP > 1): the routing weights folded into the activation, and their gradient <d y W^T, act>, exactly
    zero on the padding rows, whose NaN weights reach nothing."""
    ours, ref = _in_place_fns(activation, impl, grouped, weighted)
    args, ref_args = _in_place_args(activation, grouped)
    (_, y), (g_exp, g_x, g_w) = ours(*args)
    (_, y_ref), (g_exp_ref, g_x_ref, g_w_ref) = ref(*ref_args)
    received = np.asarray(args[-1])
    # on a GPU, float32 GEMMs run as TF32 (3-7e-4 measured on an H200: results/inplace_experts_1xh200_tf32.log)
    tol = TOL if jax.default_backend() == "cpu" else 2e-3
    assert rel_err(np.asarray(y)[received], np.asarray(y_ref)[received]) < tol
    assert rel_err(g_x, g_x_ref) < tol and not np.any(np.asarray(g_x)[~received])
    for name in g_exp:
        assert rel_err(g_exp[name], g_exp_ref[name]) < tol, name
    if weighted:
        g_w = np.asarray(g_w)
        assert rel_err(g_w[received], np.asarray(g_w_ref)[received]) < tol
        assert not np.any(g_w[~received]), g_w  # exact zeros, not NaN


@pytest.mark.parametrize("policy", ["save_dots", "save_exchange"])
def test_fp8_experts_fold_the_weights_in_without_a_gemm_rerun(policy: str) -> None:
    """FP8 experts after an exchange fold the routing weights into the activation too: weighted after
    the down-projection, d w would need its output, which no remat policy keeps, so the backward would
    rerun that FP8 GEMM. The gradient program has as many GEMMs weighted as unweighted."""
    import re

    from xmoe_jax import remat
    from xmoe_jax.config.model import FP8Config
    from xmoe_jax.fp8 import context
    from xmoe_jax.moe.experts import arrival_experts

    keys = jax.random.split(jax.random.key(0), 5)
    experts = {
        n: 0.1 * jax.random.normal(k, (2, 128, 128))
        for n, k in zip(("w_gate", "w_up", "w_down"), keys[:3], strict=True)
    }
    x_MD, weights_M = jax.random.normal(keys[3], (64, 128)), jax.random.uniform(keys[4], (64,))

    def gemms(weighted: bool) -> int:
        def loss(e, x, w):
            with context.use(FP8Config(projections=False)):
                x, w = remat.tag(x, remat.EXCHANGE_IN), remat.tag(w, remat.EXCHANGE_IN)
                y = arrival_experts(x, None, e, jnp.array([30, 20]), "swiglu", w if weighted else None)
            return jnp.sum(y.astype(jnp.float32))

        jaxpr = jax.make_jaxpr(jax.grad(remat.remat(loss, policy), argnums=(0, 1, 2)))(
            experts, x_MD, weights_M
        )
        return len(re.findall(r"dot_general\[|ragged_dot", str(jaxpr)))

    assert gemms(True) == gemms(False) > 0


def test_the_backward_computes_the_activation_afresh() -> None:
    """The experts' backward recomputes the GELU tied to its cotangent (experts._recomputed_act), for
    rows that stay on their device (combined_experts) and rows that arrived (arrival_experts): the
    compiled bf16 forward and backward evaluate the GELU twice (a tanh in the forward; the backward's
    act_grad writes tanh as an exponential, so the combined path's count holds either way). Without the
    tie XLA merges the arrival path's backward activation with the forward's (CSE: one tanh), keeping
    act and its tanh live from one pass to the other, two [R, F] arrays per layer written and read back
    (benchmarks/train_step.md)."""
    from xmoe_jax.moe.experts import arrival_experts, combined_experts

    def gelus(f, *args) -> int:
        text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile().as_text()
        return text.count(" tanh(") + text.count(" exponential(")

    experts, x_MD, _, arrival_R, gs_L, _, _ = _in_place_args("gelu", False)[0]
    arrived = gelus(
        lambda x, e: arrival_experts(x, arrival_R, e, gs_L, "gelu").astype(jnp.float32).sum(),
        x_MD.astype(jnp.bfloat16),
        experts,
    )
    T, K = 16, 2
    dest_TK = jax.random.permutation(jax.random.key(5), T * K).reshape(T, K).astype(jnp.int32)
    gs_E = jnp.full(gs_L.shape, T * K // gs_L.shape[0], jnp.int32)
    x_TD = jax.random.normal(jax.random.key(6), (T, x_MD.shape[1]), jnp.bfloat16)
    combined = gelus(
        lambda x, e: combined_experts(x, dest_TK, T * K, e, gs_E, "gelu", jnp.full((T, K), 0.5)).sum(),
        x_TD,
        experts,
    )
    assert (combined, arrived) == (2, 2)


@pytest.mark.parametrize("path", ["combined", "arrived"])
def test_the_down_projections_backward_gathers_dy_once_where_xla_gathers(path: str, monkeypatch) -> None:
    """Where XLA gathers tgmm's rows (defaults.TGMM_GATHER_IN_KERNEL: CUDA, ROCm), the down-projection's
    backward gathers dy's rows once for both its GEMMs (kernels.shared_rows): d act = dy[rows] W^T reads
    the grouped copy that d W's tgmm reads, so only the forward's up-projection gathers on load (on
    Hopper the plain gmm runs on ws; the gathering one on Pallas). The gradients are the in-kernel
    gather's. Fails with the index passed on to the d act gmm (two gathering gmm calls, not one)."""
    from xmoe_jax.kernels import defaults
    from xmoe_jax.kernels.gmm import api
    from xmoe_jax.moe.experts import arrival_experts, combined_experts

    experts, x_MD, _, arrival_R, gs_L, cot_MD, received = _in_place_args("gelu", False)[0]
    T, K = 16, 2
    dest_TK = jax.random.permutation(jax.random.key(5), T * K).reshape(T, K).astype(jnp.int32)
    gs_E = jnp.full(gs_L.shape, T * K // gs_L.shape[0], jnp.int32)
    x_TD = jax.random.normal(jax.random.key(6), (T, x_MD.shape[1]))
    w_TK = jax.random.uniform(jax.random.key(7), (T, K))
    if path == "combined":
        x, loss = x_TD, lambda x, e: (combined_experts(x, dest_TK, T * K, e, gs_E, "gelu", w_TK) ** 2).sum()
    else:
        x, loss = (
            x_MD,
            lambda x, e: (arrival_experts(x, arrival_R, e, gs_L, "gelu") * cot_MD * received[:, None]).sum(),
        )
    gathering, inner = [], api._gmm_impl

    def spy(lhs, rhs, gs, lhs_rows, out_rows, st):
        gathering.append(lhs_rows is not None and out_rows is None)
        return inner(lhs, rhs, gs, lhs_rows, out_rows, st)

    monkeypatch.setattr(api, "_gmm_impl", spy)
    grads = {}
    for in_kernel in (True, False):
        monkeypatch.setitem(defaults.TGMM_GATHER_IN_KERNEL, "cpu", in_kernel)
        gathering.clear()
        grads[in_kernel] = jax.grad(loss, argnums=(0, 1))(x, experts)
        assert sum(gathering) == (2 if in_kernel else 1), (in_kernel, gathering)
    for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False]), strict=True):
        assert rel_err(a, b) < 1e-6


# ----------------------------------------------------------------------------- push: the return inside the down-projection


@pytest.mark.parametrize("fused", ["fused", "after", "arrive"])
def test_push_returns_rows_from_inside_the_down_projection(fused: str, monkeypatch) -> None:
    """push (expert-major arrival) runs the exchanges back to the sources inside the GEMMs before them
    (experts.pushed_experts: the forward's return inside the down-projection, the backward's d x inside
    the up-projections' data gradient; on CPU their reference: the GEMM, then the push reference), and
    XMOE_FUSED_RETURN=off runs them after the GEMMs; XMOE_FUSED_ARRIVE=on also runs the exchanges that
    bring rows (the dispatch, the backward's cotangent) with the GEMM after them (kernels/push: push_gmm,
    twice per step). Each equals the dense oracle, values and gradients, with rows that overflow."""
    import sys

    import xmoe_jax.kernels.push as push_kernels
    import xmoe_jax.moe.pft as pft_module

    monkeypatch.setattr(sys.modules[__name__], "_pft_fn", _pft_fn.__wrapped__)  # traced here, with the spy
    calls, arrivals = [], []
    real, real_arrive = pft_module.pushed_experts, push_kernels.push_gmm
    monkeypatch.setattr(pft_module, "pushed_experts", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(push_kernels, "push_gmm", lambda *a, **k: arrivals.append(k) or real_arrive(*a, **k))
    if fused == "after":
        monkeypatch.setenv("XMOE_FUSED_RETURN", "off")
    if fused == "arrive":
        monkeypatch.setenv("XMOE_FUSED_ARRIVE", "on")
    cfg = dataclasses.replace(CFG_A, drop_policy="probs")
    par = ParallelConfig(dispatch="pft", recv_buffer_factor=0.5, transport="push")
    params, x = _params(cfg, _offsets(cfg.num_experts, "moderate")), _x(shift=1.0)
    out = _check(cfg, (2, 4, 1), params, x, par)
    assert int(out["aux"].num_overflow) > 0
    assert bool(calls) == (fused != "after")
    # forward: the dispatch with the first up-projection; backward: the cotangent with d act = d y W^T
    assert [k["transpose_rhs"] for k in arrivals] == ([False, True] if fused == "arrive" else [])


def test_fused_arrivals_never_run_an_exchange_again_under_remat(monkeypatch) -> None:
    """XMOE_FUSED_ARRIVE=on: one kernel yields the received rows and the first hidden, so the hidden
    cannot be recomputed alone. Autodiff through it, under a policy that recomputes the hidden
    (save_exchange), ran the whole exchange again in the backward pass (a review's finding: 15
    exchanges in the gradient program against 12). `experts._arrived` holds the whole expert MLP's
    VJP, keeping the received rows and recomputing the hidden from them (or keeping it, where the
    policy does): as many exchanges as unfused, under every policy, with both directions fused."""
    import xmoe_jax.kernels.push as push_kernels
    from xmoe_jax import remat

    cfg, mesh = dataclasses.replace(CFG_A, drop_policy="probs"), _mesh((2, 4, 1))
    par = ParallelConfig(dispatch="pft", recv_buffer_factor=0.5, transport="push")
    params, x = _params(cfg, _offsets(cfg.num_experts, "moderate")), _x(shift=1.0)
    arrivals = []
    real = push_kernels.push_gmm
    monkeypatch.setattr(
        push_kernels, "push_gmm", lambda *a, **k: arrivals.append(k["transpose_rhs"]) or real(*a, **k)
    )

    def exchanges(fused: str, mode: str) -> int:
        monkeypatch.setenv("XMOE_FUSED_ARRIVE", fused)
        arrivals.clear()

        def loss(p, x):
            y, _ = moe_layer(p, x, cfg, par, mesh=mesh)
            return jnp.sum(y)

        text = str(jax.make_jaxpr(jax.grad(remat.remat(loss, mode)))(params, x))
        return text.count("all_to_all")

    for mode in ("save_exchange", "save_dots", "full"):
        assert exchanges("on", mode) == exchanges("off", mode), mode
        exchanges("on", mode)
        assert set(arrivals) == {False, True}, mode  # the dispatch's and the cotangent's

    def grads(fused: str):  # the recomputed hidden gives the kept one's gradients
        monkeypatch.setenv("XMOE_FUSED_ARRIVE", fused)
        fn = remat.remat(
            lambda p, x: jnp.sum(moe_layer(p, x, cfg, par, mesh=mesh)[0] * _proj()), "save_exchange"
        )
        return jax.jit(jax.grad(fn, argnums=(0, 1)))(params, x)

    for got, want in zip(jax.tree.leaves(grads("on")), jax.tree.leaves(grads("off")), strict=True):
        assert rel_err(got, want) < 1e-6


def test_compact_receive_buffers_hold_a_multiple_of_8_rows():
    """The expert GEMMs run on the receive buffer in place, and our Mosaic kernels take only row
    counts of a multiple of 8 (a factor's ceil(f * T * K) sent them all to Pallas at EP 2 and 4)."""
    assert recv_rows(64, 6, 16384, 4, factor=1.2) == 117_968  # ceil(1.2 * 98,304) = 117,965
    assert recv_rows(8, 2, 6, 4) == 48 and recv_rows(8, 2, 6, 4, factor=0.5) == 8
    assert all(recv_rows(16, 3, t, 2, factor=f) % 8 == 0 for t in (5, 64, 100) for f in (None, 0.37, 1.1))


def test_rows_a_push_leaves_unwritten_are_never_read(monkeypatch) -> None:
    """On a GPU the push kernels leave the send-buffer rows no update writes undefined, such as those of
    copies that overflowed. pft must neither combine them (even at weight 0: 0 x NaN) nor read them in
    permute's backward (at weight 1). Here the reference fills such rows with NaN: values and gradients
    still equal the dense oracle."""
    import sys

    from xmoe_jax.kernels.push import xla as push_xla

    real = push_xla.push_rows_reference
    layout = (2, 4, 1)
    send_rows = T // (layout[0] * layout[1]) * CFG_A.top_k

    def undefined_where_unwritten(x_ND, meta_3X, *, out_rows, **kw):
        out = real(x_ND, meta_3X, out_rows=out_rows, **kw)
        if out_rows != send_rows:  # the receive buffer: rows past the sum are never read by the GEMMs
            return out
        hit = real(jnp.ones((x_ND.shape[0], 1), x_ND.dtype), meta_3X, out_rows=out_rows, **kw)
        return jnp.where(hit > 0, out, jnp.nan)

    monkeypatch.setattr(push_xla, "push_rows_reference", undefined_where_unwritten)
    monkeypatch.setattr(sys.modules[__name__], "_pft_fn", _pft_fn.__wrapped__)  # traced with the NaN rows
    cfg = dataclasses.replace(CFG_A, drop_policy="probs")
    par = ParallelConfig(dispatch="pft", recv_buffer_factor=0.5, transport="push")
    params, x = _params(cfg, _offsets(cfg.num_experts, "moderate")), _x(shift=1.0)
    out = _check(cfg, layout, params, x, par)
    assert int(out["aux"].num_overflow) > 0
