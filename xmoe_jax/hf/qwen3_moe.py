"""Qwen3-MoE (`Qwen3MoeForCausalLM`): RMSNorm on q and k per head, no biases, no shared expert.

Router: softmax over all experts, top-k, renormalised with `norm_topk_prob` (on in the released
models). q_norm / k_norm scale each head's K dims before RoPE (our `qk_norm: head`).
Refused: `attention_bias` (Qwen3 puts it on o_proj too), dense layers other than the first k,
sliding-window attention, RoPE scaling.
"""

from __future__ import annotations

from xmoe_jax.config import ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import Rule, linear


class Qwen3Moe(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        a.refuse(hf.get("use_sliding_window", False), "qwen3_moe: use_sliding_window=true is not implemented")
        a.refuse(
            hf.get("attention_bias", False),
            "qwen3_moe: attention_bias=true (also on o_proj) is not implemented",
        )
        fields = a.common_fields(hf, rope_default=1e4)
        moe = dict(
            num_experts=a.num_experts(hf),
            top_k=int(hf["num_experts_per_tok"]),
            expert_hidden=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)),
        )
        fields.update(
            dense_hidden=int(hf["intermediate_size"]),
            num_dense_layers=a.sparse_layers(hf, "qwen3_moe"),
            qk_norm="head",
        )
        return a.model_config(fields, moe)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = a.common_unsupported(cfg, dense_layers=True, shared=False)
        if cfg.qk_norm != "head" or cfg.qkv_bias:
            reasons.append("Qwen3-MoE's attention has a per-head q/k norm (qk_norm: head) and no biases")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        return {
            **a.common_hf(cfg, self),
            "num_experts": cfg.moe.num_experts,
            "moe_intermediate_size": cfg.moe.expert_hidden,
            "norm_topk_prob": cfg.moe.norm_topk_prob,
            "intermediate_size": cfg.dense_hidden,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.num_dense_layers)),
            "attention_bias": False,
            "use_sliding_window": False,
        }

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        def moe(p: str) -> list[Rule]:
            block = f"{a.LAYER}.mlp"
            return [
                Rule(f"{p}/moe/router/kernel", f"{block}.gate.weight", linear(1)),
                *a.expert_rules(f"{p}/moe/experts", f"{block}.experts", f"{block}.experts"),
            ]

        return a.decoder_rules(cfg, moe)


QWEN3_MOE = Qwen3Moe("qwen3_moe", "Qwen3MoeForCausalLM")
