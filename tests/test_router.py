"""Routing, balancing losses and capacity against independent NumPy float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import keep_ref, load_balance_ref, route_ref, softmax, z_loss_ref

from xmoe_jax.config import MoEConfig
from xmoe_jax.moe import router
from xmoe_jax.moe.capacity import keep_mask

T, D = 32, 16


def _inputs(seed: int, num_experts: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    x_TD = rng.standard_normal((T, D)).astype(np.float32)
    kernel_DE = (scale * rng.standard_normal((D, num_experts)) / np.sqrt(D)).astype(np.float32)
    return x_TD, kernel_DE


def _check_route(cfg: MoEConfig, x_TD, kernel_DE, bias_E=None):
    got = router.route(jnp.asarray(x_TD), jnp.asarray(kernel_DE), bias_E, cfg)
    idx, wts, logits, scores = route_ref(x_TD, kernel_DE, None if bias_E is None else np.asarray(bias_E), cfg)
    np.testing.assert_array_equal(np.asarray(got.topk_idx_TK), idx)
    np.testing.assert_allclose(np.asarray(got.topk_weight_TK), wts, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got.logits_TE), logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.scores_TE), scores, rtol=1e-5, atol=1e-7)
    assert got.topk_idx_TK.dtype == jnp.int32 and got.topk_weight_TK.dtype == jnp.float32
    return got, wts


# ----------------------------------------------------------------------------- softmax


def test_softmax_mixtral_weights_are_softmax_over_the_chosen_logits() -> None:
    cfg = MoEConfig(num_experts=8, top_k=2, norm_topk_prob=True)
    x_TD, kernel_DE = _inputs(0, 8)
    got, wts = _check_route(cfg, x_TD, kernel_DE)
    # Mixtral's definition: softmax over the k chosen logits
    logits = x_TD.astype(np.float64) @ kernel_DE
    chosen = np.take_along_axis(logits, np.asarray(got.topk_idx_TK), -1)
    np.testing.assert_allclose(wts, softmax(chosen), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(got.topk_weight_TK).sum(-1), 1.0, rtol=1e-6)


def test_softmax_qwen2_without_renormalisation_keeps_raw_probs() -> None:
    cfg = MoEConfig(num_experts=8, top_k=3, norm_topk_prob=False, routed_scaling_factor=1.5)
    x_TD, kernel_DE = _inputs(1, 8)
    got, _ = _check_route(cfg, x_TD, kernel_DE)
    sums = np.asarray(got.topk_weight_TK).sum(-1) / 1.5
    assert np.all(sums < 1.0) and np.all(sums > 3 / 8 - 1e-6)


# ----------------------------------------------------------------------------- sigmoid


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_bias_changes_selection_but_not_weights(norm: bool) -> None:
    cfg = MoEConfig(
        num_experts=8, top_k=2, score_func="sigmoid", norm_topk_prob=norm, routed_scaling_factor=2.0
    )
    x_TD, kernel_DE = _inputs(2, 8)
    plain, _ = _check_route(cfg, x_TD, kernel_DE, jnp.zeros(8))
    bias_E = jnp.zeros(8).at[5].set(10.0)  # forces expert 5 into every token's choice
    biased, _ = _check_route(cfg, x_TD, kernel_DE, bias_E)
    idx = np.asarray(biased.topk_idx_TK)
    assert np.all(idx[:, 0] == 5)
    assert not np.array_equal(idx, np.asarray(plain.topk_idx_TK))
    s_TE = 1 / (1 + np.exp(-(x_TD.astype(np.float64) @ kernel_DE)))
    raw = np.take_along_axis(s_TE, idx, -1)
    expect = raw / raw.sum(-1, keepdims=True) if norm else raw
    np.testing.assert_allclose(np.asarray(biased.topk_weight_TK), 2.0 * expect, rtol=1e-5)


@pytest.mark.parametrize(
    "num_groups, topk_groups, top_k, norm, scale",
    [(4, 2, 3, True, 2.5), (8, 3, 2, False, 1.0), (4, 1, 2, True, 1.0), (2, 2, 4, False, 0.7)],
)
def test_sigmoid_group_limited(num_groups, topk_groups, top_k, norm, scale) -> None:
    num_experts = 16
    cfg = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        score_func="sigmoid",
        num_groups=num_groups,
        topk_groups=topk_groups,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    x_TD, kernel_DE = _inputs(3, num_experts, scale=2.0)
    bias_E = jnp.asarray(np.random.default_rng(4).normal(0, 0.3, num_experts), jnp.float32)
    got, _ = _check_route(cfg, x_TD, kernel_DE, bias_E)
    # every choice lies in at most topk_groups groups
    groups = np.asarray(got.topk_idx_TK) // (num_experts // num_groups)
    assert max(len(set(row)) for row in groups) <= topk_groups


def test_group_ranking_uses_top2_sum_not_max() -> None:
    # group 0 holds the single best expert, group 1 the better pair: top-2 sums must pick group 1
    cfg = MoEConfig(num_experts=4, top_k=1, score_func="sigmoid", num_groups=2, topk_groups=1)
    kernel_DE = np.zeros((1, 4), np.float32)
    bias_E = jnp.asarray([0.9, 0.0, 0.6, 0.6], jnp.float32)
    got = router.route(jnp.ones((1, 1)), jnp.asarray(kernel_DE), bias_E, cfg)
    assert int(got.topk_idx_TK[0, 0]) in (2, 3)
    np.testing.assert_allclose(float(got.topk_weight_TK[0, 0]), 1.0)  # normalised over k=1


def test_no_gradient_into_router_bias() -> None:
    cfg = MoEConfig(
        num_experts=8, top_k=2, score_func="sigmoid", num_groups=4, topk_groups=2, norm_topk_prob=True
    )
    x_TD, kernel_DE = _inputs(5, 8)
    proj = jnp.asarray(np.random.default_rng(6).standard_normal((T, 2)), jnp.float32)

    def loss(kernel, bias):
        r = router.route(jnp.asarray(x_TD), kernel, bias, cfg)
        lb = router.load_balance_loss(r.scores_TE, r.topk_idx_TK, cfg)
        return jnp.sum(r.topk_weight_TK * proj) + lb + router.z_loss(r.logits_TE)

    bias_E = jnp.asarray(np.random.default_rng(7).normal(0, 0.1, 8), jnp.float32)
    g_kernel, g_bias = jax.grad(loss, argnums=(0, 1))(jnp.asarray(kernel_DE), bias_E)
    np.testing.assert_array_equal(np.asarray(g_bias), 0.0)
    assert float(jnp.abs(g_kernel).max()) > 1e-3


# ----------------------------------------------------------------------------- counts and losses


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_force_balance_gives_every_expert_the_same_count_and_weights_from_the_scores(score_func) -> None:
    """The benchmarking router: distinct experts per token, T*K/E copies each, weights = the
    (renormalised) scores of the learned router at the forced experts."""
    cfg = MoEConfig(num_experts=8, top_k=3, score_func=score_func, force_balance=True, norm_topk_prob=True)
    x_TD, kernel_DE = _inputs(7, cfg.num_experts, scale=3.0)
    got = router.route(jnp.asarray(x_TD), jnp.asarray(kernel_DE), None, cfg)
    idx = np.asarray(got.topk_idx_TK)
    assert all(len(set(row)) == cfg.top_k for row in idx)
    np.testing.assert_array_equal(np.bincount(idx.ravel(), minlength=8), np.full(8, T * cfg.top_k // 8))
    _, _, logits, _ = route_ref(x_TD, kernel_DE, None, cfg)
    score = softmax(logits) if score_func == "softmax" else 1 / (1 + np.exp(-logits))
    want = np.take_along_axis(score, idx, axis=-1)
    np.testing.assert_allclose(np.asarray(got.topk_weight_TK), want / want.sum(-1, keepdims=True), rtol=1e-5)


def test_tokens_per_expert_counts_every_copy() -> None:
    idx = np.random.default_rng(8).integers(0, 6, size=(20, 3))
    got = np.asarray(router.tokens_per_expert(jnp.asarray(idx, jnp.int32), 6))
    np.testing.assert_array_equal(got, np.bincount(idx.reshape(-1), minlength=6))
    assert got.dtype == np.int32


def test_load_balance_loss_is_one_for_uniform_routing() -> None:
    num_experts, top_k, num_tokens = 8, 2, 16
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k)
    idx = np.stack([np.arange(num_tokens) % num_experts, (np.arange(num_tokens) + 3) % num_experts], 1)
    uniform = jnp.full((num_tokens, num_experts), 1 / num_experts)
    loss = router.load_balance_loss(uniform, jnp.asarray(idx, jnp.int32), cfg)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)
    # equal counts make any row-stochastic scores give exactly 1
    scores = softmax(np.random.default_rng(9).standard_normal((num_tokens, num_experts)))
    loss = router.load_balance_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(idx, jnp.int32), cfg)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)


@pytest.mark.parametrize(
    "kind, seq_len", [("micro_batch", None), ("micro_batch", 8), ("sequence", 8), ("sequence", 32)]
)
def test_load_balance_loss_formula(kind: str, seq_len: int | None) -> None:
    cfg = MoEConfig(num_experts=8, top_k=2, aux_loss_type=kind)
    x_TD, kernel_DE = _inputs(10, 8, scale=3.0)
    r = router.route(jnp.asarray(x_TD), jnp.asarray(kernel_DE), None, cfg)
    got = float(router.load_balance_loss(r.scores_TE, r.topk_idx_TK, cfg, seq_len=seq_len))
    group = T if kind == "micro_batch" else seq_len
    want = load_balance_ref(np.asarray(r.scores_TE), np.asarray(r.topk_idx_TK), 8, 2, group)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want > 1.0  # skewed routing is penalised


def test_sequence_loss_differs_from_micro_batch_when_sequences_are_skewed() -> None:
    # two sequences each piled onto different experts: balanced overall, unbalanced per sequence
    num_experts = 4
    cfg_mb = MoEConfig(num_experts=num_experts, top_k=1, aux_loss_type="micro_batch")
    cfg_seq = MoEConfig(num_experts=num_experts, top_k=1, aux_loss_type="sequence")
    idx = jnp.asarray([[0], [1], [0], [1], [2], [3], [2], [3]], jnp.int32)
    scores = jax.nn.one_hot(idx[:, 0], num_experts)
    mb = float(router.load_balance_loss(scores, idx, cfg_mb, seq_len=4))
    seq = float(router.load_balance_loss(scores, idx, cfg_seq, seq_len=4))
    np.testing.assert_allclose(mb, load_balance_ref(scores, idx, num_experts, 1, 8), rtol=1e-6)
    np.testing.assert_allclose(seq, load_balance_ref(scores, idx, num_experts, 1, 4), rtol=1e-6)
    np.testing.assert_allclose([mb, seq], [1.0, 2.0], rtol=1e-6)


def test_aux_loss_none_is_zero() -> None:
    cfg = MoEConfig(num_experts=4, top_k=1, aux_loss_type="none")
    scores = jax.nn.one_hot(jnp.zeros(4, jnp.int32), 4)
    assert float(router.load_balance_loss(scores, jnp.zeros((4, 1), jnp.int32), cfg)) == 0.0


def test_z_loss_formula() -> None:
    logits = np.random.default_rng(11).normal(0, 4, (T, 8)).astype(np.float32)
    np.testing.assert_allclose(float(router.z_loss(jnp.asarray(logits))), z_loss_ref(logits), rtol=1e-5)


def test_update_router_bias_moves_by_exactly_rate() -> None:
    rate = 0.125
    bias = np.asarray([0.5, -0.25, 0.0, 1.0, 0.0], np.float32)
    counts = np.asarray([10, 2, 6, 6, 6], np.int32)  # mean 6: expert 0 over, 1 under, rest balanced
    new = np.asarray(router.update_router_bias(jnp.asarray(bias), jnp.asarray(counts), rate))
    np.testing.assert_allclose(new - bias, [-rate, rate, 0.0, 0.0, 0.0], atol=1e-7)


# ----------------------------------------------------------------------------- capacity


def _keep(idx, wts, num_experts, capacity, policy):
    keep, pos = keep_mask(
        jnp.asarray(idx, jnp.int32), jnp.asarray(wts, jnp.float32), num_experts, capacity, policy
    )
    return np.asarray(keep), np.asarray(pos)


def test_probs_policy_keeps_highest_weight_copies() -> None:
    # expert 0 receives 4 copies; with C=2 the two heaviest stay, whatever their slot or token
    idx = np.asarray([[0, 1], [1, 0], [0, 2], [2, 0]])
    wts = np.asarray([[0.1, 0.9], [0.6, 0.4], [0.8, 0.2], [0.3, 0.7]], np.float32)
    keep, _ = _keep(idx, wts, 3, 2, "probs")
    # expert 0 holds weights 0.1, 0.4, 0.8, 0.7: keep 0.8 (token 2) and 0.7 (token 3)
    expect = np.asarray([[False, True], [True, False], [True, True], [True, True]])
    np.testing.assert_array_equal(keep, expect)
    np.testing.assert_array_equal(keep, keep_ref(idx, wts, 3, 2, "probs"))


def test_position_policy_keeps_first_choices_before_second_choices() -> None:
    # expert 0: second choices of tokens 0,1 come before token 3's first choice in token order,
    # yet the first choice wins under GShard priority
    idx = np.asarray([[1, 0], [2, 0], [1, 2], [0, 1]])
    wts = np.asarray([[0.9, 0.1], [0.9, 0.1], [0.5, 0.5], [0.9, 0.1]], np.float32)
    keep, pos = _keep(idx, wts, 3, 1, "position")
    assert keep[3, 0] and not keep[0, 1] and not keep[1, 1]
    assert pos[3, 0] == 0 and pos[0, 1] == 1 and pos[1, 1] == 2
    np.testing.assert_array_equal(keep, keep_ref(idx, wts, 3, 1, "position"))


def test_capacity_none_keeps_everything() -> None:
    idx = np.zeros((6, 1), np.int64)
    keep, pos = _keep(idx, np.ones((6, 1)), 2, None, "probs")
    assert keep.all()
    np.testing.assert_array_equal(np.sort(pos[:, 0]), np.arange(6))


@st.composite
def _routings(draw):
    num_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, min(3, num_experts)))
    num_tokens = draw(st.integers(1, 10))
    idx = np.asarray(
        [draw(st.permutations(range(num_experts)))[:top_k] for _ in range(num_tokens)], np.int64
    ).reshape(num_tokens, top_k)
    # coarse weights so that ties (broken by token, then slot) are common
    wts = (
        np.asarray(
            draw(st.lists(st.integers(0, 4), min_size=num_tokens * top_k, max_size=num_tokens * top_k)),
            np.float32,
        ).reshape(num_tokens, top_k)
        / 4
    )
    capacity = draw(st.one_of(st.none(), st.integers(1, num_tokens + 1)))
    policy = draw(st.sampled_from(["probs", "position"]))
    return idx, wts, num_experts, capacity, policy


@settings(max_examples=25, deadline=None)
@given(_routings())
def test_keep_mask_property(routing) -> None:
    idx, wts, num_experts, capacity, policy = routing
    keep, pos = _keep(idx, wts, num_experts, capacity, policy)
    np.testing.assert_array_equal(keep, keep_ref(idx, wts, num_experts, capacity, policy))
    for e in range(num_experts):
        mine = idx == e
        count = int(mine.sum())
        assert int(keep[mine].sum()) == (count if capacity is None else min(count, capacity))
        # positions inside one expert's queue are 0..count-1, each once
        np.testing.assert_array_equal(np.sort(pos[mine]), np.arange(count))
