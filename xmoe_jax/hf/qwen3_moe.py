"""Qwen3-MoE (`Qwen3MoeForCausalLM`): RMSNorm on q and k per head, no biases, no shared expert.

Router: softmax over all experts, top-k, renormalised with `norm_topk_prob` (on in the released
models). q_norm / k_norm scale each head's K dims before RoPE (our `qk_norm: head`).
Refused: `attention_bias` (Qwen3 puts it on o_proj too), dense layers other than the first k,
sliding-window attention, RoPE scaling.
"""

from __future__ import annotations

from xmoe_jax.config import ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import Rule


class Qwen3Moe(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        a.refuse(
            hf.get("attention_bias", False),
            "qwen3_moe: attention_bias=true (also on o_proj) is not implemented",
        )
        fields = {
            **a.common_fields(hf, rope_default=1e4),
            **a.qwen_layer_fields(hf, "qwen3_moe"),
            "qk_norm": "head",
        }
        return a.model_config(fields, a.routed_moe(hf, "moe_intermediate_size", aux_default=0.001))

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = a.common_unsupported(cfg, dense_layers=True, shared=False)
        if cfg.qk_norm != "head" or cfg.qkv_bias:
            reasons.append("Qwen3-MoE's attention has a per-head q/k norm (qk_norm: head) and no biases")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        return {**a.common_hf(cfg, self), **a.qwen_layer_hf(cfg), "attention_bias": False}

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        return a.decoder_rules(cfg, a.moe_block_rules)


QWEN3_MOE = Qwen3Moe("qwen3_moe", "Qwen3MoeForCausalLM")
