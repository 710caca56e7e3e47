"""Mixtral (`MixtralForCausalLM`): every layer MoE, no shared experts, plain attention.

Router: softmax over all experts, top-k, renormalised over the k (our `softmax` router with
`norm_topk_prob`). Experts: w1 = gate, w3 = up, w2 = down, under `block_sparse_moe`
(per expert, as `save_pretrained` writes) or fused under `mlp.experts` (transformers 5).
Refused: sliding-window attention (`sliding_window` set), RoPE scaling, non-SwiGLU MLPs.
"""

from __future__ import annotations

from xmoe_jax.config import ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import Rule, linear


class Mixtral(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        a.refuse(
            hf.get("sliding_window") is not None,
            f"mixtral: sliding_window={hf.get('sliding_window')} (sliding-window attention) is not "
            "implemented; only full causal attention is",
        )
        a.warn_ignored(hf, {"router_jitter_noise": 0.0, "attention_dropout": 0.0})
        fields = a.common_fields(hf, rope_default=1e6)
        moe = dict(
            num_experts=a.num_experts(hf),
            top_k=int(hf["num_experts_per_tok"]),
            expert_hidden=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)),
        )
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
            block = f"{a.LAYER}.block_sparse_moe"
            return [
                Rule(f"{p}/moe/router/kernel", f"{block}.gate.weight", linear(1)),
                *a.expert_rules(
                    f"{p}/moe/experts", f"{block}.experts", f"{a.LAYER}.mlp.experts", ("w1", "w3", "w2")
                ),
            ]

        return a.decoder_rules(cfg, moe)


MIXTRAL = Mixtral("mixtral", "MixtralForCausalLM")
