"""Analytic parameter counts for a `ModelConfig`.

Counts follow the parameter layout of `xmoe_jax.model` exactly (D hidden, V vocab, H heads,
KV key/value heads, Dh head size, Fd dense hidden, E experts, F expert hidden, Fs shared hidden):

- ``embed`` [V, D], ``lm_head`` [D, V] unless ``tie_embeddings``, final RMSNorm scale [D];
- per layer: two RMSNorm scales [D]; attention wq [D, H*Dh], wk/wv [D, KV*Dh], wo [H*Dh, D],
  with ``qkv_bias`` biases [H*Dh] + 2 [KV*Dh]; with ``qk_norm`` scales on q and k ("norms"):
  [Dh] each per head, [H*Dh] + [KV*Dh] over the full width;
- dense layers (the first ``num_dense_layers``): MLP of hidden Fd, 3 matrices for SwiGLU
  (gate, up, down) or 2 for GELU (up, down);
- MoE layers: router kernel [D, E]; routed experts E * (3 or 2) * D * F; shared experts fused
  into one MLP of hidden Fs with the MoE activation, plus a [D, 1] gate when
  ``shared_expert_gate``.

The router's selection bias [E] (sigmoid routing) is a non-trained buffer and is not counted.
"Active" parameters are those one token touches: everything except the routed experts, plus
``top_k`` experts' worth of routed-expert weights per MoE layer. Totals include embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmoe_jax.config import ModelConfig

GIB = 2**30


def _mlp_matrices(activation: str) -> int:
    """Weight matrices of one MLP: SwiGLU has gate/up/down, GELU up/down."""
    return 3 if activation == "swiglu" else 2


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model; `breakdown` rows sum to `total`."""

    total: int
    active: int  # per token
    embedding: int  # embed + lm_head
    breakdown: dict[str, int]

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def _breakdown(cfg: ModelConfig) -> dict[str, int]:
    d, v, num_layers = cfg.hidden, cfg.vocab_size, cfg.num_layers
    q_dim = cfg.num_heads * cfg.head_size
    kv_dim = cfg.kv_heads * cfg.head_size
    attn_per_layer = d * q_dim + 2 * d * kv_dim + q_dim * d
    if cfg.qkv_bias:
        attn_per_layer += q_dim + 2 * kv_dim
    qk_norm_per_layer = {"none": 0, "head": 2 * cfg.head_size, "full": q_dim + kv_dim}[cfg.qk_norm]
    dense_per_layer = _mlp_matrices(cfg.dense_activation) * d * cfg.dense_hidden

    rows = {
        "embed": v * d,
        "lm_head": 0 if cfg.tie_embeddings else d * v,
        "norms": (2 * num_layers + 1) * d + num_layers * qk_norm_per_layer,
        "attention": num_layers * attn_per_layer,
        "dense_mlp": cfg.num_dense_layers * dense_per_layer,
        "router": 0,
        "routed_experts": 0,
        "shared_experts": 0,
    }
    moe, num_moe = cfg.moe, cfg.num_moe_layers
    if moe is not None and num_moe > 0:
        per_expert = _mlp_matrices(moe.activation) * d * moe.expert_hidden
        shared = _mlp_matrices(moe.activation) * d * moe.shared_hidden
        if moe.num_shared_experts > 0 and moe.shared_expert_gate:
            shared += d
        rows["router"] = num_moe * d * moe.num_experts
        rows["routed_experts"] = num_moe * moe.num_experts * per_expert
        rows["shared_experts"] = num_moe * shared
    return rows


def count_params(model_cfg: ModelConfig) -> ParamCount:
    """Total, per-token active and embedding parameter counts, computed from the config.

    The router's selection bias [E] is a non-trained buffer and is not counted.
    """
    rows = _breakdown(model_cfg)
    total = sum(rows.values())
    active = total - rows["routed_experts"]
    moe = model_cfg.moe
    if moe is not None and model_cfg.num_moe_layers > 0:
        per_expert = _mlp_matrices(moe.activation) * model_cfg.hidden * moe.expert_hidden
        active += model_cfg.num_moe_layers * moe.top_k * per_expert
    return ParamCount(
        total=total,
        active=active,
        embedding=rows["embed"] + rows["lm_head"],
        breakdown=rows,
    )


def paper_units(model_cfg: ModelConfig) -> float:
    """(attention + routed experts) / 2**30: the X-MoE paper's model-size convention.

    The paper reports ``L * (4 H^2 + E * 2 * H * F)`` in 2^30 units: embeddings, routers, norms,
    dense and shared MLPs are excluded. For its configs (MHA, GELU 2-matrix experts, all layers
    MoE) this equals our attention + routed-expert count.
    """
    rows = _breakdown(model_cfg)
    return (rows["attention"] + rows["routed_experts"]) / GIB


def format_param_table(model_cfg: ModelConfig) -> str:
    """An aligned text table: breakdown rows, total, active, embedding (billions and raw)."""
    pc = count_params(model_cfg)
    lines = [(name, n) for name, n in pc.breakdown.items()]
    summary = [("total", pc.total), ("active/token", pc.active), ("embedding", pc.embedding)]
    width = max(len(name) for name, _ in lines + summary + [("paper units (2^30)", 0)])
    raw_width = len(f"{pc.total:,}")

    def row(name: str, n: int) -> str:
        return f"{name:<{width}}  {n / 1e9:>9.2f}B  {n:>{raw_width},}"

    rule = "-" * (width + 14 + raw_width)
    out = [f"{'component':<{width}}  {'billions':>10}  {'count':>{raw_width}}", rule]
    out += [row(name, n) for name, n in lines]
    out.append(rule)
    out += [row(name, n) for name, n in summary]
    out.append(f"{'paper units (2^30)':<{width}}  {paper_units(model_cfg):>9.2f}")
    return "\n".join(out)
