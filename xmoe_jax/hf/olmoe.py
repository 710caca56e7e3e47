"""OLMoE (`OlmoeForCausalLM`): RMSNorm on q and k over the whole projected width, every layer MoE.

Router: softmax over all experts, top-k, renormalised with `norm_topk_prob` (off in
OLMoE-1B-7B). q_norm normalises all H*K query dims together and k_norm all G*K key dims
(transformers' OlmoeAttention, before the reshape into heads; our `qk_norm: full`), sized
with hidden_size / num_attention_heads per head. Refused: `clip_qkv` (clamping q/k/v),
`attention_bias`, a head_dim other than hidden_size / num_attention_heads, RoPE scaling.
"""

from __future__ import annotations

from xmoe_jax.config import ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import Rule


class Olmoe(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        a.refuse(
            hf.get("clip_qkv") is not None,
            f"olmoe: clip_qkv={hf.get('clip_qkv')} (clamping q/k/v) is not implemented; only null is",
        )
        a.refuse(hf.get("attention_bias", False), "olmoe: attention_bias=true is not implemented")
        fields = a.common_fields(hf, rope_default=1e4)
        a.refuse(
            fields["head_dim"] != fields["hidden"] // fields["num_heads"],
            "olmoe: head_dim must be hidden_size / num_attention_heads (its q/k norms are sized so)",
        )
        moe = a.routed_moe(hf, "intermediate_size", aux_default=0.01)
        fields.update(dense_hidden=moe["expert_hidden"], num_dense_layers=0, qk_norm="full")
        return a.model_config(fields, moe)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = a.common_unsupported(cfg, dense_layers=False, shared=False)
        if cfg.qk_norm != "full" or cfg.qkv_bias:
            reasons.append("OLMoE's attention has a full-width q/k norm (qk_norm: full) and no biases")
        if cfg.head_size * cfg.num_heads != cfg.hidden:
            reasons.append("OLMoE needs head_dim * num_heads == hidden")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        hf = {
            **a.common_hf(cfg, self),
            "num_experts": cfg.moe.num_experts,
            "intermediate_size": cfg.moe.expert_hidden,
            "norm_topk_prob": cfg.moe.norm_topk_prob,
            "clip_qkv": None,
            "attention_bias": False,
        }
        del hf["head_dim"]  # OLMoE derives it (hidden_size / num_attention_heads)
        return hf

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        return a.decoder_rules(cfg, a.moe_block_rules)


OLMOE = Olmoe("olmoe", "OlmoeForCausalLM")
