"""Analytic parameter counts: paper anchors, DeepSeekMoE 16B, and a hand-computed tiny model."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import pytest

from xmoe_jax.config import ModelConfig, MoEConfig, load_config
from xmoe_jax.model import model_spec
from xmoe_jax.params import count_params, format_param_table, paper_units

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _model(name: str) -> ModelConfig:
    return load_config(CONFIGS / f"{name}.yaml").model


@pytest.mark.parametrize(
    "name, expected",
    [("small", 10.06), ("medium", 55.23), ("large", 201.36), ("super", 545.43)],
)
def test_paper_units_match_xmoe_table(name: str, expected: float) -> None:
    # docs/design.md#model-table: L*(4H^2 + E*2*H*F) / 2^30.
    assert round(paper_units(_model(name)), 2) == expected


def test_deepseek_moe_16b_matches_published_counts() -> None:
    pc = count_params(_model("deepseek_moe_16b"))
    assert pc.total == pytest.approx(16.4e9, abs=0.05e9)
    assert pc.active == pytest.approx(2.8e9, abs=0.05e9)


# Hand-computed: V=10 D=8 L=3 H=2 KV=1 Dh=4 Fd=16 (swiglu, 1 dense layer);
# 2 MoE layers with E=4 k=2 F=6 swiglu, one shared expert (Fs=6) with a gate.
TINY = ModelConfig(
    vocab_size=10,
    hidden=8,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    dense_hidden=16,
    dense_activation="swiglu",
    num_dense_layers=1,
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=6,
        num_shared_experts=1,
        activation="swiglu",
        shared_expert_gate=True,
    ),
)


def test_tiny_hand_computed() -> None:
    pc = count_params(TINY)
    embed = 10 * 8
    norms = (2 * 3 + 1) * 8  # 56
    attention = 3 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8)  # 3 * 192 = 576
    dense = 3 * 8 * 16  # 384
    router = 2 * 8 * 4  # 64
    routed = 2 * 4 * (3 * 8 * 6)  # 1152
    shared = 2 * (3 * 8 * 6 + 8)  # 304
    assert pc.breakdown == {
        "embed": embed,
        "lm_head": embed,
        "norms": norms,
        "attention": attention,
        "dense_mlp": dense,
        "router": router,
        "routed_experts": routed,
        "shared_experts": shared,
    }
    assert pc.total == 2696
    assert pc.embedding == 160
    assert pc.active == 2696 - 1152 + 2 * 2 * (3 * 8 * 6)  # 2120
    assert pc.non_embedding == 2696 - 160
    assert sum(pc.breakdown.values()) == pc.total


def test_gelu_has_two_matrices_swiglu_three() -> None:
    swiglu = count_params(TINY)
    moe_gelu = count_params(dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, activation="gelu")))
    # One D x F matrix fewer per routed expert (2 layers * 4 experts) and per shared MLP (2 layers).
    assert swiglu.total - moe_gelu.total == 2 * 4 * 8 * 6 + 2 * 8 * 6
    # Active loses top_k experts' worth plus the shared MLP's matrix.
    assert swiglu.active - moe_gelu.active == 2 * 2 * 8 * 6 + 2 * 8 * 6
    dense_gelu = count_params(dataclasses.replace(TINY, dense_activation="gelu"))
    assert swiglu.total - dense_gelu.total == 8 * 16
    assert swiglu.active - dense_gelu.active == 8 * 16


def test_router_bias_is_not_counted() -> None:
    sigmoid = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, score_func="sigmoid"))
    assert sigmoid.moe.has_router_bias
    assert count_params(sigmoid) == count_params(TINY)


def test_dense_only_model() -> None:
    cfg = dataclasses.replace(TINY, moe=None, num_dense_layers=3)
    pc = count_params(cfg)
    assert pc.breakdown["routed_experts"] == pc.breakdown["router"] == pc.breakdown["shared_experts"] == 0
    assert pc.total == pc.active == 160 + 56 + 576 + 3 * 384


def test_format_param_table_lists_rows() -> None:
    text = format_param_table(_model("small"))
    for label in ("attention", "routed_experts", "total", "active", "embedding", "paper units"):
        assert label in text
    assert "10.06" in text
    assert f"{count_params(_model('small')).total:,}" in text


@pytest.mark.parametrize(
    "variant, delta",
    [
        ({"qkv_bias": True}, 3 * (8 + 4 + 4)),  # q [H*Dh] + k, v [KV*Dh] per layer
        ({"qk_norm": "head"}, 3 * (4 + 4)),  # q and k scales [Dh] per layer
        ({"qk_norm": "full"}, 3 * (8 + 4)),  # [H*Dh] and [KV*Dh] per layer
        ({"tie_embeddings": True}, -80),  # no lm_head
        ({"qkv_bias": True, "qk_norm": "full", "tie_embeddings": True}, 48 + 36 - 80),
    ],
)
def test_attention_variants_hand_computed_and_match_the_spec(variant: dict, delta: int) -> None:
    cfg = dataclasses.replace(TINY, **variant)
    assert count_params(cfg).total == 2696 + delta
    spec = model_spec(cfg)  # abstract
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(spec.params_shape)) == count_params(cfg).total
