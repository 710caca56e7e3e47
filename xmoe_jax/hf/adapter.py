"""What every architecture adapter provides, and the pieces the LLaMA-style families share.

An adapter (one small module per family, torchtitan's "state-dict adapter") says:
  `to_model_config(hf)`   a HuggingFace `config.json` dict -> our ModelConfig, refusing with a
                          `ConversionError` what we do not implement (naming the key);
  `unsupported(cfg)`      why our ModelConfig cannot be written as this architecture (None: it can);
  `to_hf_config(cfg)`     our ModelConfig -> the `config.json` fields of this architecture;
  `rules(cfg)`            the tensor table (mapping.py): HF names <-> our leaves;
  `with_tensors(cfg, hf, keys)`  the config once the checkpoint's tensor names are known (what
                          config.json cannot say, e.g. whether the MTP module is in the files);
  `ignored_tensors`       name suffixes import may skip (copies of tensors it reads elsewhere).

The common decoder (embedding, RMSNorms, q/k/v/o projections, optional q/k bias and norms,
dense SwiGLU MLPs, head) is named alike in Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE; each family
adds its MoE block's names and config keys. DeepSeek-V2/V3 (deepseek.py) share the embedding,
norms, MLP and MoE names but have their own attention (MLA) and RoPE (YaRN).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from xmoe_jax.config import ConfigError, ModelConfig, MoEConfig, RopeScalingConfig
from xmoe_jax.hf.mapping import FLAT, SAME, ConversionError, Fused, Rule, linear

log = logging.getLogger("xmoe_jax")
LAYER = "model.layers.{layer}"
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


@dataclass(frozen=True)
class Adapter:
    model_type: str
    architecture: str
    ignored_tensors: tuple[str, ...] = ()

    def with_tensors(self, cfg: ModelConfig, hf: dict, keys: set[str]) -> ModelConfig:
        return cfg

    def to_model_config(self, hf: dict) -> ModelConfig:
        raise NotImplementedError

    def unsupported(self, cfg: ModelConfig) -> str | None:
        raise NotImplementedError

    def to_hf_config(self, cfg: ModelConfig) -> dict:
        raise NotImplementedError

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        raise NotImplementedError


def refuse(cond: bool, msg: str) -> None:
    if cond:
        raise ConversionError(msg)


def num_experts(hf: dict) -> int:
    """`num_experts` or `num_local_experts` (transformers aliases them per family)."""
    for key in ("num_experts", "num_local_experts"):
        if hf.get(key) is not None:
            return int(hf[key])
    raise ConversionError("config.json has neither num_experts nor num_local_experts")


def rope_config(hf: dict, default: float) -> tuple[float, RopeScalingConfig | None]:
    """(RoPE base, YaRN scaling or None) from `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling` (DeepSeek's releases); kinds other than default and yarn are
    refused. Absent mscale keys read as 0, as transformers reads them (rope.py)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", default)))
    if kind == "default":
        return theta, None
    refuse(
        kind != "yarn",
        f"config.json asks for RoPE scaling {kind!r}; xmoe_jax implements plain RoPE and YaRN only",
    )
    refuse(
        params.get("attention_factor") is not None,
        "rope scaling: an explicit attention_factor is not implemented",
    )
    refuse(params.get("truncate", True) is not True, "rope scaling: truncate=false is not implemented")
    original = int(params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096))
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    scaling = RopeScalingConfig(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )
    return theta, scaling


def rope_hf(cfg: ModelConfig) -> dict:
    """config.json's RoPE keys: `rope_theta`, and `rope_parameters` with `rope_scaling` (the same
    YaRN fields, as DeepSeek's releases write them) when scaled."""
    out = {
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    }
    s = cfg.rope_scaling
    if s is not None:
        fields = dict(factor=s.factor, original_max_position_embeddings=s.original_max_position_embeddings)
        fields.update(
            beta_fast=s.beta_fast, beta_slow=s.beta_slow, mscale=s.mscale, mscale_all_dim=s.mscale_all_dim
        )
        out["rope_scaling"] = {"type": "yarn", **fields}
        out["rope_parameters"] = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **fields}
    return out


def rope_theta(hf: dict, default: float) -> float:
    """RoPE base; any rope scaling is refused (the LLaMA-style families here take plain RoPE)."""
    theta, scaling = rope_config(hf, default)
    refuse(
        scaling is not None,
        "config.json asks for RoPE scaling 'yarn'; xmoe_jax converts YaRN for DeepSeek-V2/V3 only: "
        "convert a model without rope scaling",
    )
    return theta


def common_fields(hf: dict, rope_default: float) -> dict:
    """ModelConfig fields of the shared decoder, from config.json."""
    refuse(
        hf.get("hidden_act", "silu") != "silu",
        f"hidden_act={hf.get('hidden_act')!r}: only SwiGLU (silu) MLPs are implemented",
    )
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        max_seq_len=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=rope_theta(hf, rope_default),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def model_config(fields: dict, moe: dict) -> ModelConfig:
    """ModelConfig(**fields, moe=MoEConfig(**moe)), a ConfigError reported as a conversion error."""
    try:
        return ModelConfig(**fields, moe=MoEConfig(**moe))
    except ConfigError as e:
        raise ConversionError(f"config.json makes an invalid xmoe_jax config: {e}") from e


def common_hf(cfg: ModelConfig, adapter: Adapter) -> dict:
    """config.json fields of the shared decoder."""
    return {
        "architectures": [adapter.architecture],
        "model_type": adapter.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        **rope_hf(cfg),
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_weight,
    }


def common_unsupported(cfg: ModelConfig, *, dense_layers: bool, shared: bool) -> list[str]:
    """What no adapter here can write; `dense_layers` / `shared`: whether the family has them."""
    moe = cfg.moe
    reasons = []
    if moe is None or cfg.num_moe_layers == 0:
        return ["the model has no MoE layers"]
    if moe.score_func != "softmax" or moe.num_groups != 1 or moe.routed_scaling_factor != 1.0:
        reasons.append(
            "the router is not a plain softmax top-k (score_func, num_groups, routed_scaling_factor)"
        )
    if moe.activation != "swiglu" or (cfg.num_dense_layers and cfg.dense_activation != "swiglu"):
        reasons.append("an MLP is not SwiGLU")
    if cfg.num_dense_layers and not dense_layers:
        reasons.append("it has dense layers (num_dense_layers > 0)")
    if moe.num_shared_experts and not shared:
        reasons.append("it has shared experts")
    return reasons + layout_unsupported(cfg)


def layout_unsupported(cfg: ModelConfig) -> list[str]:
    """Attention, RoPE and MTP that only the DeepSeek adapters write."""
    reasons = []
    if cfg.attention_type != "mha":
        reasons.append(
            f"its attention is {cfg.attention_type!r} (multi-head latent attention: DeepSeek-V2/V3)"
        )
    if cfg.rope_scaling is not None:
        reasons.append("it scales RoPE (YaRN: DeepSeek-V2/V3)")
    if cfg.mtp_depth:
        reasons.append("it has multi-token prediction modules (DeepSeek-V3)")
    return reasons


def decoder_rules(cfg: ModelConfig, moe_rules) -> list[Rule]:
    """The shared decoder's tensors; `moe_rules(prefix)` adds the MoE block's (prefix "params/moe_layers")."""
    rules = [
        Rule("params/embed", "model.embed_tokens.weight", SAME),
        Rule("params/final_norm/scale", "model.norm.weight", FLAT),
    ]
    if not cfg.tie_embeddings:
        rules.append(Rule("params/lm_head", "lm_head.weight", linear(1)))
    for stack, present in (("dense_layers", cfg.num_dense_layers), ("moe_layers", cfg.num_moe_layers)):
        if not present:
            continue
        p = f"params/{stack}"
        rules += [
            Rule(f"{p}/attn_norm/scale", f"{LAYER}.input_layernorm.weight", FLAT),
            Rule(f"{p}/mlp_norm/scale", f"{LAYER}.post_attention_layernorm.weight", FLAT),
            Rule(f"{p}/attn/wq", f"{LAYER}.self_attn.q_proj.weight", linear(1)),
            Rule(f"{p}/attn/wk", f"{LAYER}.self_attn.k_proj.weight", linear(1)),
            Rule(f"{p}/attn/wv", f"{LAYER}.self_attn.v_proj.weight", linear(1)),
            Rule(f"{p}/attn/wo", f"{LAYER}.self_attn.o_proj.weight", linear(2)),
        ]
        if cfg.qkv_bias:
            rules += [Rule(f"{p}/attn/b{n}", f"{LAYER}.self_attn.{n}_proj.bias", FLAT) for n in "qkv"]
        if cfg.qk_norm != "none":
            rules += [
                Rule(f"{p}/attn/{n}_norm/scale", f"{LAYER}.self_attn.{n}_norm.weight", FLAT) for n in "qk"
            ]
        if stack == "dense_layers":
            rules += mlp_rules(f"{p}/mlp", f"{LAYER}.mlp")
        else:
            rules += moe_rules(p)
    return rules


def mlp_rules(ours: str, hf: str, names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A SwiGLU MLP: our w_gate/w_up [D,F], w_down [F,D] <- HF gate/up/down Linear weights."""
    return [
        Rule(f"{ours}/{w}", f"{hf}.{n}.weight", linear(1))
        for w, n in zip(("w_gate", "w_up", "w_down"), names, strict=True)
    ]


def expert_rules(ours: str, hf_experts: str, fused_experts: str, names=("gate_proj", "up_proj", "down_proj")):
    """Routed experts [E,D,F] / [E,F,D] <- HF per-expert Linear weights `{hf_experts}.{expert}.<name>`,
    or the fused `{fused_experts}.gate_up_proj` [E,2F,D] / `.down_proj` [E,D,F]."""
    fused = (Fused(f"{fused_experts}.gate_up_proj", 0), Fused(f"{fused_experts}.gate_up_proj", 1))
    fused += (Fused(f"{fused_experts}.down_proj"),)
    return [
        Rule(f"{ours}/{w}", f"{hf_experts}.{{expert}}.{n}.weight", linear(1), f)
        for w, n, f in zip(("w_gate", "w_up", "w_down"), names, fused, strict=True)
    ]


def routed_moe(hf: dict, hidden_key: str, aux_default: float, **extra) -> dict:
    """MoEConfig fields of the routed experts, from config.json (`extra`: the family's own)."""
    return dict(
        num_experts=num_experts(hf),
        top_k=int(hf["num_experts_per_tok"]),
        expert_hidden=int(hf[hidden_key]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        aux_loss_weight=float(hf.get("router_aux_loss_coef", aux_default)),
        **extra,
    )


def moe_block_rules(
    p: str, block: str = f"{LAYER}.mlp", names=("gate_proj", "up_proj", "down_proj")
) -> list[Rule]:
    """Router [D,E] <- `{block}.gate.weight` [E,D]; experts <- `{block}.experts` (fused in `mlp.experts`)."""
    return [
        Rule(f"{p}/moe/router/kernel", f"{block}.gate.weight", linear(1)),
        *expert_rules(f"{p}/moe/experts", f"{block}.experts", f"{LAYER}.mlp.experts", names),
    ]


def qwen_layer_fields(hf: dict, family: str) -> dict:
    """Qwen2/3-MoE: full attention only; dense layers only first (`decoder_sparse_step` 1 and
    `mlp_only_layers` = [0..k-1]: our first num_dense_layers; any other interleaving is refused)."""
    refuse(hf.get("use_sliding_window", False), f"{family}: use_sliding_window=true is not implemented")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    refuse(
        layer_types != {"full_attention"}, f"{family}: layer_types {sorted(layer_types)} are not supported"
    )
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    only = sorted(hf.get("mlp_only_layers") or [])
    refuse(
        step != 1,
        f"{family}: decoder_sparse_step={step} (MoE on every {step}th layer) is not supported; "
        "xmoe_jax runs the first num_dense_layers layers dense and every later one MoE",
    )
    refuse(
        only != list(range(len(only))),
        f"{family}: mlp_only_layers={only} is not supported; only dense layers first (0..k-1) are",
    )
    return dict(dense_hidden=int(hf["intermediate_size"]), num_dense_layers=len(only))


def qwen_layer_hf(cfg: ModelConfig) -> dict:
    """config.json fields of Qwen2/3-MoE's routed experts and layer pattern."""
    return {
        "num_experts": cfg.moe.num_experts,
        "moe_intermediate_size": cfg.moe.expert_hidden,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "intermediate_size": cfg.dense_hidden,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.num_dense_layers)),
        "use_sliding_window": False,
    }


def warn_ignored(hf: dict, keys: dict) -> None:
    """Logs config.json settings that only matter in training HF's way (jitter, dropout)."""
    for key, neutral in keys.items():
        if hf.get(key, neutral) not in (neutral, None):
            log.warning("config.json %s=%s is a training-time setting xmoe_jax ignores", key, hf[key])
