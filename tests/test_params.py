"""Analytic parameter counts: paper anchors, DeepSeekMoE 16B, and a hand-computed tiny model."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import pytest

from xmoe_jax.config import MLAConfig, ModelConfig, MoEConfig, load_config
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


def test_deepseek_v2_lite_and_v3_match_published_counts() -> None:
    """V2-Lite: 15.7B total, 2.4B active; V3: 671B total (685B with the MTP module, whose 14B also
    hold copies of the embedding and head), 37B active. DeepSeek counts active parameters
    without the input embedding (params.py)."""
    lite = count_params(_model("deepseek_v2_lite"))
    assert lite.total == pytest.approx(15.7e9, abs=0.05e9) and lite.breakdown["mtp"] == 0
    assert lite.active_without_input_embedding == pytest.approx(2.4e9, abs=0.06e9)
    v3 = count_params(_model("deepseek_v3"))
    assert v3.main == pytest.approx(671e9, abs=0.5e9)
    # the published 14B is 685B - 671B; the module with its copies is 13.46B, the sum 684.5B
    embed_and_head = v3.breakdown["embed"] + v3.breakdown["lm_head"]
    assert v3.breakdown["mtp"] + embed_and_head == pytest.approx(14e9, abs=0.6e9)
    assert v3.total + embed_and_head == pytest.approx(685e9, abs=0.6e9)
    assert v3.active_without_input_embedding == pytest.approx(37e9, abs=0.5e9)


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
        "mtp": 0,
    }
    assert pc.total == 2696
    assert pc.embedding == 160
    assert pc.active == 2696 - 1152 + 2 * 2 * (3 * 8 * 6)  # 2120
    assert pc.non_embedding == 2696 - 160
    assert sum(pc.breakdown.values()) == pc.total


MLA = MLAConfig(kv_lora_rank=4, q_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3)


@pytest.mark.parametrize("q_lora", [3, None])
def test_mla_and_mtp_hand_computed_and_match_the_spec(q_lora) -> None:
    mla = dataclasses.replace(MLA, q_lora_rank=q_lora)
    cfg = dataclasses.replace(TINY, attention_type="mla", mla=mla, num_kv_heads=None, head_dim=None)
    # per layer, H=2 D=8 C=4 N=R=2 U=3: queries (8 + 2*4) * 3 with a [3] norm, or 8 * 2*4;
    # wkv_a 8 * (4+2), wkv_b 4 * 2*(2+3), wo 2*3 * 8, kv norm [4]
    q, q_norm = (48, 3) if q_lora else (64, 0)
    attention = q + 48 + 40 + 48
    pc = count_params(cfg)
    assert pc.breakdown["attention"] == 3 * attention
    assert pc.breakdown["norms"] == 56 + 3 * (q_norm + 4)
    mtp = dataclasses.replace(cfg, mtp_depth=2)
    # an MTP module: eh_proj 2*8*8, a MoE block (attention, router 32, experts 576, shared 152),
    # enorm, hnorm, out norm and the block's two norms (5 * 8), the latents' norms
    module = 128 + attention + 32 + 576 + 152 + 40 + q_norm + 4
    pm = count_params(mtp)
    assert pm.breakdown["mtp"] == 2 * module and pm.main == pc.total
    assert pm.active == pc.active  # MTP is not part of the main model's active parameters
    assert pm.mtp_active == 2 * (128 + attention + 32 + 2 * 144 + 152 + 80)  # top-2 experts, the head
    for c in (cfg, mtp):
        spec = model_spec(c)
        assert sum(math.prod(x.shape) for x in jax.tree.leaves(spec.params_shape)) == count_params(c).total


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
