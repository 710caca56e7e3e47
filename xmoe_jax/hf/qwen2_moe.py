"""Qwen2-MoE (`Qwen2MoeForCausalLM`): q/k/v biases, one gated shared expert per MoE layer.

Router: softmax over all experts, top-k, renormalised only with `norm_topk_prob` (off in the
released models). Shared expert: a SwiGLU MLP of `shared_expert_intermediate_size` whose output
is scaled by sigmoid(x @ shared_expert_gate) (our shared expert with `shared_expert_gate`).
Dense layers: supported when they come first (`mlp_only_layers` = [0..k-1], `decoder_sparse_step`
1); any other interleaving is refused, as are sliding-window attention and RoPE scaling.
"""

from __future__ import annotations

from xmoe_jax.config import ModelConfig
from xmoe_jax.hf import adapter as a
from xmoe_jax.hf.mapping import Rule, linear


class Qwen2Moe(a.Adapter):
    def to_model_config(self, hf: dict) -> ModelConfig:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        a.refuse(shared < 1, "qwen2_moe: shared_expert_intermediate_size must be >= 1 (every layer has one)")
        fields = {**a.common_fields(hf, rope_default=1e4), **a.qwen_layer_fields(hf, "qwen2_moe")}
        fields["qkv_bias"] = bool(hf.get("qkv_bias", True))  # before transformers 5 always on
        moe = a.routed_moe(
            hf, "moe_intermediate_size", aux_default=0.001,
            num_shared_experts=1, shared_expert_hidden=shared, shared_expert_gate=True,
        )  # fmt: skip
        return a.model_config(fields, moe)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reasons = a.common_unsupported(cfg, dense_layers=True, shared=True)
        if cfg.moe is not None and not (cfg.moe.num_shared_experts and cfg.moe.shared_expert_gate):
            reasons.append("Qwen2-MoE has a gated shared expert in every MoE layer (shared_expert_gate)")
        if cfg.qk_norm != "none":
            reasons.append("Qwen2-MoE's attention has no q/k norm")
        return "; ".join(reasons) or None

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        return {
            **a.common_hf(cfg, self),
            **a.qwen_layer_hf(cfg),
            "shared_expert_intermediate_size": cfg.moe.shared_hidden,
            "qkv_bias": cfg.qkv_bias,
        }

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        def moe(p: str) -> list[Rule]:
            block = f"{a.LAYER}.mlp"
            return [
                *a.moe_block_rules(p),
                *a.mlp_rules(f"{p}/moe/shared", f"{block}.shared_expert"),
                Rule(f"{p}/moe/shared/gate", f"{block}.shared_expert_gate.weight", linear(1)),
            ]

        return a.decoder_rules(cfg, moe)


QWEN2_MOE = Qwen2Moe("qwen2_moe", "Qwen2MoeForCausalLM")
