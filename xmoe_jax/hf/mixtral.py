"""Mixtral (`MixtralForCausalLM`): every layer MoE, no shared experts, plain attention.

Router: softmax over all experts, top-k, renormalised over the k (our `softmax` router with
`norm_topk_prob`). Experts: w1 = gate, w3 = up, w2 = down, under `block_sparse_moe`
(per expert, as `save_pretrained` writes) or fused under `mlp.experts` (transformers 5).
Refused: sliding-window attention (`sliding_window` set), RoPE scaling, non-SwiGLU MLPs.
"""

from __future__ import annotations

from xmoe_jax.config import ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import Rule


class Mixtral(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        a.refuse(
            hf.get("sliding_window") is not None,
            f"mixtral: sliding_window={hf.get('sliding_window')} (sliding-window attention) is not "
            "implemented; only full causal attention is",
        )
        a.warn_ignored(hf, {"router_jitter_noise": 0.0, "attention_dropout": 0.0})
        fields = a.common_fields(hf, rope_default=1e6)
        moe = {**a.routed_moe(hf, "intermediate_size", aux_default=0.001), "norm_topk_prob": True}
        return a.model_config({**fields, "dense_hidden": moe["expert_hidden"], "num_dense_layers": 0}, moe)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = a.common_unsupported(cfg, dense_layers=False, shared=False)
        if cfg.moe is not None and not cfg.moe.norm_topk_prob:
            reasons.append("Mixtral always renormalises the top-k weights (norm_topk_prob)")
        if cfg.qkv_bias or cfg.qk_norm != "none":
            reasons.append("Mixtral's attention has no q/k/v bias and no q/k norm")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        return {
            **a.common_hf(cfg, self),
            "num_local_experts": cfg.moe.num_experts,
            "intermediate_size": cfg.moe.expert_hidden,
            "sliding_window": None,
        }

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        def moe(p: str) -> list[Rule]:
            return a.moe_block_rules(p, f"{a.LAYER}.block_sparse_moe", ("w1", "w3", "w2"))

        return a.decoder_rules(cfg, moe)


MIXTRAL = Mixtral("mixtral", "MixtralForCausalLM")
