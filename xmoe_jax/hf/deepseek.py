"""DeepSeek-V2 (`DeepseekV2ForCausalLM`, V2-Lite) and DeepSeek-V3 (`DeepseekV3ForCausalLM`, also
Kimi K2's layout): multi-head latent attention, YaRN, first-k dense layers, shared experts.

Attention (our model.mla): q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj (`q_lora_rank`);
kv_a_proj_with_mqa = [kv latent | shared RoPE key] (our wkv_a), kv_a_layernorm, kv_b_proj =
per head [k_nope | v] (our wkv_b), o_proj. RoPE pairs are interleaved (V2 always, V3 with
`rope_interleave`, its default); `rope_scaling`/`rope_parameters` yarn maps to model.rope_scaling.
Layers: the first `first_k_dense_replace` dense (`intermediate_size`), then MoE with
`n_shared_experts` x `moe_intermediate_size` of shared expert and `n_routed_experts` routed ones.
Routers:
  V2: softmax over all experts, top-k (`topk_method` greedy: V2-Lite), weights times
      `routed_scaling_factor`, never renormalised (transformers ignores `norm_topk_prob`; a true
      one is refused); `group_limited_greedy` (V2's softmax group routing) is refused.
  V3: sigmoid, `e_score_correction_bias` (our router bias) for the choice, `n_group` groups of
      which `topk_group` are kept, `norm_topk_prob`, `routed_scaling_factor`.
Multi-token prediction (V3): the released checkpoint holds `num_nextn_predict_layers` modules as
layers L.. (enorm, hnorm, eh_proj, a decoder layer, shared_head.norm, and copies of the embedding
and head, which import skips: ours are shared). transformers' DeepseekV3ForCausalLM does not
hold them (`save_pretrained` drops them): import takes as many as the files have (model.mtp_depth),
export writes ours without the copies. Refused: FP8 checkpoints (`quantization_config`:
dequantize to bf16 first), attention or MLP biases, `moe_layer_freq` other than 1.
"""

from __future__ import annotations

import dataclasses
import logging

from xmoe_jax.config import MLAConfig, ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import FLAT, Rule, linear

log = logging.getLogger("xmoe_jax")


def _fields(hf: dict, family: str, interleave: bool) -> dict:
    """ModelConfig fields of the decoder (MLA, RoPE, layer pattern) from config.json."""
    quant = hf.get("quantization_config")
    a.refuse(
        quant is not None,
        f"{family}: the checkpoint is quantized ({(quant or {}).get('quant_method')}); dequantize it to "
        "bfloat16 first (DeepSeek's inference/fp8_cast_bf16.py)",
    )
    a.refuse(hf.get("attention_bias", False), f"{family}: attention_bias=true is not implemented")
    a.refuse(hf.get("mlp_bias", False), f"{family}: mlp_bias=true is not implemented")
    a.refuse(
        int(hf.get("moe_layer_freq", 1)) != 1,
        f"{family}: moe_layer_freq={hf.get('moe_layer_freq')} is not supported; xmoe_jax runs every layer "
        "after first_k_dense_replace as MoE",
    )
    a.refuse(
        hf.get("hidden_act", "silu") != "silu",
        f"hidden_act={hf.get('hidden_act')!r}: only SwiGLU (silu) MLPs are implemented",
    )
    heads = int(hf["num_attention_heads"])
    a.refuse(
        int(hf.get("num_key_value_heads") or heads) != heads,
        f"{family}: num_key_value_heads must equal num_attention_heads (MLA has one key/value head per query head)",
    )
    theta, scaling = a.rope_config(hf, 10000.0)
    q_lora = hf.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        rope_interleave=interleave,
    )
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        dense_hidden=int(hf["intermediate_size"]),
        num_dense_layers=int(hf.get("first_k_dense_replace") or 0),
        max_seq_len=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_type="mla",
        mla=mla,
    )


def _moe(hf: dict, family: str, **extra) -> dict:
    shared = int(hf.get("n_shared_experts") or 0)
    a.refuse(
        shared < 1, f"{family}: n_shared_experts must be >= 1 (transformers builds a shared expert per layer)"
    )
    return dict(
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_hidden=int(hf["moe_intermediate_size"]),
        num_shared_experts=shared,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        aux_loss_type="sequence" if hf.get("seq_aux", True) else "micro_batch",
        **extra,
    )


def _unsupported(cfg: ModelConfig, version: str) -> list[str]:
    """Why no DeepSeek adapter can write the model (the rest is per version)."""
    moe, reasons = cfg.moe, []
    if cfg.attention_type != "mla":
        reasons.append(f"DeepSeek-{version} uses multi-head latent attention (model.attention_type: mla)")
    if moe is None or cfg.num_moe_layers == 0:
        return [*reasons, "the model has no MoE layers"]
    if moe.activation != "swiglu" or (cfg.num_dense_layers and cfg.dense_activation != "swiglu"):
        reasons.append("an MLP is not SwiGLU")
    if moe.num_shared_experts < 1 or moe.shared_expert_gate or moe.shared_hidden % moe.expert_hidden:
        reasons.append(
            f"DeepSeek-{version} has ungated shared experts of n x expert_hidden in every MoE layer"
        )
    return reasons


def _hf(cfg: ModelConfig, adapter: a.Adapter) -> dict:
    """config.json fields both versions share."""
    m, moe = cfg.mla, cfg.moe
    hf = a.common_hf(cfg, adapter)
    hf.update(
        head_dim=m.qk_rope_head_dim,  # transformers' convention for DeepSeek (the rotary dims)
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        intermediate_size=cfg.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        first_k_dense_replace=cfg.num_dense_layers,
        n_routed_experts=moe.num_experts,
        n_shared_experts=moe.shared_hidden // moe.expert_hidden,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.norm_topk_prob,
        moe_layer_freq=1,
        attention_bias=False,
        seq_aux=moe.aux_loss_type == "sequence",
        aux_loss_alpha=moe.aux_loss_weight,
    )
    return hf


def _attention_rules(p: str, layer: str, cfg: ModelConfig) -> list[Rule]:
    attn = f"{layer}.self_attn"
    if cfg.mla.q_lora_rank is None:
        rules = [Rule(f"{p}/attn/wq", f"{attn}.q_proj.weight", linear(1))]
    else:
        rules = [
            Rule(f"{p}/attn/wq_a", f"{attn}.q_a_proj.weight", linear(1)),
            Rule(f"{p}/attn/q_norm/scale", f"{attn}.q_a_layernorm.weight", FLAT),
            Rule(f"{p}/attn/wq_b", f"{attn}.q_b_proj.weight", linear(1)),
        ]
    return rules + [
        Rule(f"{p}/attn/wkv_a", f"{attn}.kv_a_proj_with_mqa.weight", linear(1)),
        Rule(f"{p}/attn/kv_norm/scale", f"{attn}.kv_a_layernorm.weight", FLAT),
        Rule(f"{p}/attn/wkv_b", f"{attn}.kv_b_proj.weight", linear(1)),
        Rule(f"{p}/attn/wo", f"{attn}.o_proj.weight", linear(2)),
    ]


def _layer_rules(p: str, bias_p: str, is_moe: bool, cfg: ModelConfig, router_bias: bool) -> list[Rule]:
    """One decoder layer under `p` ("params/moe_layers", "params/mtp_layers/block", ...)."""
    layer = a.LAYER
    rules = [
        Rule(f"{p}/attn_norm/scale", f"{layer}.input_layernorm.weight", FLAT),
        Rule(f"{p}/mlp_norm/scale", f"{layer}.post_attention_layernorm.weight", FLAT),
        *_attention_rules(p, layer, cfg),
    ]
    if not is_moe:
        return rules + a.mlp_rules(f"{p}/mlp", f"{layer}.mlp")
    rules += [*a.moe_block_rules(p), *a.mlp_rules(f"{p}/moe/shared", f"{layer}.mlp.shared_experts")]
    if router_bias:
        rules.append(Rule(f"{bias_p}/moe/router/bias", f"{layer}.mlp.gate.e_score_correction_bias", FLAT))
    return rules


def _rules(cfg: ModelConfig, router_bias: bool) -> list[Rule]:
    rules = [
        Rule("params/embed", "model.embed_tokens.weight", a.SAME),
        Rule("params/final_norm/scale", "model.norm.weight", FLAT),
    ]
    if not cfg.tie_embeddings:
        rules.append(Rule("params/lm_head", "lm_head.weight", linear(1)))
    for stack, present in (("dense_layers", cfg.num_dense_layers), ("moe_layers", cfg.num_moe_layers)):
        if present:
            rules += _layer_rules(f"params/{stack}", f"bias/{stack}", stack == "moe_layers", cfg, router_bias)
    if cfg.mtp_depth:  # DeepSeek-V3's modules after the L layers (model/mtp.py)
        p, layer = "params/mtp_layers", a.LAYER
        rules += [
            Rule(f"{p}/enorm/scale", f"{layer}.enorm.weight", FLAT),
            Rule(f"{p}/hnorm/scale", f"{layer}.hnorm.weight", FLAT),
            Rule(f"{p}/eh_proj", f"{layer}.eh_proj.weight", linear(2)),
            Rule(f"{p}/out_norm/scale", f"{layer}.shared_head.norm.weight", FLAT),
            *_layer_rules(f"{p}/block", "bias/mtp_layers/block", cfg.num_moe_layers > 0, cfg, router_bias),
        ]
    return rules


class DeepseekV2(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        method = hf.get("topk_method", "greedy")
        a.refuse(
            method != "greedy",
            f"deepseek_v2: topk_method={method!r} is not implemented (xmoe_jax's group-limited routing is "
            "V3's sigmoid one); DeepSeek-V2-Lite routes greedily",
        )
        a.refuse(
            bool(hf.get("norm_topk_prob", False)),
            "deepseek_v2: norm_topk_prob=true: transformers' DeepseekV2 ignores it while DeepSeek's code "
            "renormalises; refusing the ambiguity",
        )
        a.refuse(
            hf.get("scoring_func", "softmax") != "softmax",
            f"deepseek_v2: scoring_func={hf.get('scoring_func')!r}: transformers' DeepseekV2 routes by softmax",
        )
        moe = _moe(hf, "deepseek_v2", score_func="softmax", norm_topk_prob=False)
        moe["aux_loss_weight"] = float(hf.get("aux_loss_alpha", 0.001))
        return a.model_config(_fields(hf, "deepseek_v2", interleave=True), moe)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = _unsupported(cfg, "V2")
        if cfg.moe is not None and (cfg.moe.score_func != "softmax" or cfg.moe.num_groups != 1):
            reasons.append("DeepSeek-V2's router (in transformers) is a softmax top-k without groups")
        if cfg.moe is not None and cfg.moe.norm_topk_prob:
            reasons.append("DeepSeek-V2's router (in transformers) never renormalises (norm_topk_prob)")
        if cfg.mla is not None and not cfg.mla.rope_interleave:
            reasons.append("DeepSeek-V2 rotates interleaved RoPE pairs (mla.rope_interleave)")
        if cfg.mtp_depth:
            reasons.append("DeepSeek-V2 has no multi-token prediction modules")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        return {
            **_hf(cfg, self),
            "topk_method": "greedy",
            "scoring_func": "softmax",
            "n_group": 1,
            "topk_group": 1,
        }

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        return _rules(cfg, router_bias=False)


class DeepseekV3(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        a.refuse(
            hf.get("scoring_func", "sigmoid") != "sigmoid",
            f"deepseek_v3: scoring_func={hf.get('scoring_func')!r}: DeepseekV3 routes by sigmoid scores",
        )
        a.refuse(
            hf.get("topk_method", "noaux_tc") != "noaux_tc",
            f"deepseek_v3: topk_method={hf.get('topk_method')!r}: only noaux_tc (transformers' and V3's) is",
        )
        moe = _moe(
            hf, "deepseek_v3", score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_groups=int(hf.get("n_group") or 1), topk_groups=int(hf.get("topk_group") or 1),
            aux_loss_weight=float(hf.get("aux_loss_alpha", 0.0001)), bias_update_rate=0.001,
        )  # fmt: skip
        fields = _fields(hf, "deepseek_v3", interleave=bool(hf.get("rope_interleave", True)))
        return a.model_config(fields, moe)

    def with_tensors(self, cfg: ModelConfig, hf: dict, keys: set[str]) -> ModelConfig:
        """model.mtp_depth: the MTP modules the files hold (config.json's num_nextn_predict_layers
        counts them in DeepSeek's release but not after transformers' save_pretrained)."""
        wanted = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)
        depth = 0
        while depth < wanted and f"model.layers.{cfg.num_layers + depth}.eh_proj.weight" in keys:
            depth += 1
        if depth < wanted:
            log.info(
                "config.json names %d MTP module(s), the files hold %d: imported with model.mtp_depth=%d",
                wanted, depth, depth,
            )  # fmt: skip
        return dataclasses.replace(cfg, mtp_depth=depth)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = _unsupported(cfg, "V3")
        moe = cfg.moe
        if moe is not None and moe.score_func != "sigmoid":
            reasons.append("DeepSeek-V3's router is sigmoid (score_func)")
        if moe is not None and moe.num_experts // moe.num_groups < 2:
            reasons.append("DeepSeek-V3 ranks groups by their two best experts: >= 2 experts per group")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        return {
            **_hf(cfg, self),
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "n_group": cfg.moe.num_groups,
            "topk_group": cfg.moe.topk_groups,
            "rope_interleave": cfg.mla.rope_interleave,
            "num_nextn_predict_layers": cfg.mtp_depth,
        }

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        return _rules(cfg, router_bias=True)


MTP_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")  # in DeepSeek's MTP layers
DEEPSEEK_V2 = DeepseekV2("deepseek_v2", "DeepseekV2ForCausalLM")
DEEPSEEK_V3 = DeepseekV3("deepseek_v3", "DeepseekV3ForCausalLM", ignored_tensors=MTP_COPIES)
