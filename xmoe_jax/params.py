"""Analytic parameter counts for a `ModelConfig`.

Counts follow the parameter layout of `xmoe_jax.model` exactly (D hidden, V vocab, H heads,
KV key/value heads, Dh head size, Fd dense hidden, E experts, F expert hidden, Fs shared hidden):

- ``embed`` [V, D], ``lm_head`` [D, V] unless ``tie_embeddings``, final RMSNorm scale [D];
- per layer: two RMSNorm scales [D]; attention wq [D, H*Dh], wk/wv [D, KV*Dh], wo [H*Dh, D],
  with ``qkv_bias`` biases [H*Dh] + 2 [KV*Dh]; with ``qk_norm`` scales on q and k ("norms"):
  [Dh] each per head, [H*Dh] + [KV*Dh] over the full width; multi-head latent attention
  (C kv_lora_rank, Q q_lora_rank, N + R query/key and U value dims per head): wq [D, H*(N+R)] or
  wq_a [D, Q] + wq_b [Q, H*(N+R)], wkv_a [D, C+R], wkv_b [C, H*(N+U)], wo [H*U, D], and the
  latents' norm scales [Q] and [C] ("norms");
- dense layers (the first ``num_dense_layers``): MLP of hidden Fd, 3 matrices for SwiGLU
  (gate, up, down) or 2 for GELU (up, down);
- MoE layers: router kernel [D, E]; routed experts E * (3 or 2) * D * F; shared experts fused
  into one MLP of hidden Fs with the MoE activation, plus a [D, 1] gate when
  ``shared_expert_gate``;
- multi-token prediction ("mtp", ``mtp_depth`` modules): per module three norms [D], eh_proj
  [2D, D] and one block (MoE when the model has MoE layers); embedding and head are shared.

The router's selection bias [E] (sigmoid routing) is a non-trained buffer and is not counted.
"Active" parameters are those one token of the main model touches: everything except the
routed experts and the MTP modules (a training-time addition, left out of DeepSeek-V3's 37B),
plus ``top_k`` experts' worth of routed-expert weights per MoE layer; they include the
embedding and the head (DeepSeekMoE 16B's 2.8B counts both). DeepSeek-V2, V2-Lite and V3 report
active parameters without the input embedding (a lookup, not a matmul; the head stays):
``active_without_input_embedding``. Totals include embeddings and MTP; ``main`` leaves MTP out
(DeepSeek-V3: 671B main + 14B MTP module as published, whose 14B also hold copies of the
embedding and head).
"""

from __future__ import annotations

from dataclasses import dataclass

from xmoe_jax.config import ModelConfig
from xmoe_jax.units import format_count

GIB = 2**30


def _mlp_matrices(activation: str) -> int:
    """Weight matrices of one MLP: SwiGLU has gate/up/down, GELU up/down."""
    return 3 if activation == "swiglu" else 2


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model; `breakdown` rows sum to `total`."""

    total: int
    active: int  # per token, main model
    embedding: int  # embed + lm_head
    breakdown: dict[str, int]
    mtp_active: int = 0  # per token, the MTP modules' matmul weights (the shared head once per module)

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def main(self) -> int:
        """Without the multi-token prediction modules."""
        return self.total - self.breakdown["mtp"]

    @property
    def active_without_input_embedding(self) -> int:
        """DeepSeek-V2/V3's convention: the input embedding is a lookup (kept when it is also the head)."""
        tied = self.breakdown["lm_head"] == 0
        return self.active if tied else self.active - self.breakdown["embed"]


def _attention(cfg: ModelConfig) -> tuple[int, int]:
    """(weights, norm scales) of one layer's attention."""
    d, h = cfg.hidden, cfg.num_heads
    if cfg.mla is not None:
        m = cfg.mla
        if m.q_lora_rank is None:
            q, norms = d * h * m.qk_head_dim, 0
        else:
            q, norms = (d + h * m.qk_head_dim) * m.q_lora_rank, m.q_lora_rank
        kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (
            m.qk_nope_head_dim + m.v_head_dim
        )
        return q + kv + h * m.v_head_dim * d, norms + m.kv_lora_rank
    q_dim = h * cfg.head_size
    kv_dim = cfg.kv_heads * cfg.head_size
    weights = d * q_dim + 2 * d * kv_dim + q_dim * d
    if cfg.qkv_bias:
        weights += q_dim + 2 * kv_dim
    return weights, {"none": 0, "head": 2 * cfg.head_size, "full": q_dim + kv_dim}[cfg.qk_norm]


def _moe_rows(cfg: ModelConfig) -> dict[str, int]:
    """router, routed experts (all and one token's) and shared experts of one MoE layer."""
    moe, d = cfg.moe, cfg.hidden
    per_expert = _mlp_matrices(moe.activation) * d * moe.expert_hidden
    shared = _mlp_matrices(moe.activation) * d * moe.shared_hidden
    if moe.num_shared_experts > 0 and moe.shared_expert_gate:
        shared += d
    return {
        "router": d * moe.num_experts,
        "routed_experts": moe.num_experts * per_expert,
        "active_experts": moe.top_k * per_expert,
        "shared_experts": shared,
    }


def _mtp_module(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, per-token active matmul weights incl. the shared head) of one MTP module."""
    d = cfg.hidden
    attn, attn_norms = _attention(cfg)
    base = 2 * d * d + attn
    if cfg.num_moe_layers:
        rows = _moe_rows(cfg)
        ffn = rows["router"] + rows["routed_experts"] + rows["shared_experts"]
        active_ffn = rows["router"] + rows["active_experts"] + rows["shared_experts"]
    else:
        ffn = active_ffn = _mlp_matrices(cfg.dense_activation) * d * cfg.dense_hidden
    return base + ffn + 5 * d + attn_norms, base + active_ffn + d * cfg.vocab_size


def _breakdown(cfg: ModelConfig) -> dict[str, int]:
    d, v, num_layers = cfg.hidden, cfg.vocab_size, cfg.num_layers
    attn_per_layer, attn_norms_per_layer = _attention(cfg)
    dense_per_layer = _mlp_matrices(cfg.dense_activation) * d * cfg.dense_hidden

    rows = {
        "embed": v * d,
        "lm_head": 0 if cfg.tie_embeddings else d * v,
        "norms": (2 * num_layers + 1) * d + num_layers * attn_norms_per_layer,
        "attention": num_layers * attn_per_layer,
        "dense_mlp": cfg.num_dense_layers * dense_per_layer,
        "router": 0,
        "routed_experts": 0,
        "shared_experts": 0,
        "mtp": cfg.mtp_depth * _mtp_module(cfg)[0],
    }
    if cfg.num_moe_layers > 0:
        moe_rows = _moe_rows(cfg)
        for name in ("router", "routed_experts", "shared_experts"):
            rows[name] = cfg.num_moe_layers * moe_rows[name]
    return rows


def count_params(model_cfg: ModelConfig) -> ParamCount:
    """Total, per-token active and embedding parameter counts, computed from the config.

    The router's selection bias [E] is a non-trained buffer and is not counted.
    """
    rows = _breakdown(model_cfg)
    total = sum(rows.values())
    active = total - rows["routed_experts"] - rows["mtp"]
    if model_cfg.num_moe_layers > 0:
        active += model_cfg.num_moe_layers * _moe_rows(model_cfg)["active_experts"]
    return ParamCount(
        total=total,
        active=active,
        embedding=rows["embed"] + rows["lm_head"],
        breakdown=rows,
        mtp_active=model_cfg.mtp_depth * _mtp_module(model_cfg)[1],
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
    """An aligned text table: breakdown rows, total, active, embedding (each in the unit that fits
    it, K/M/B/T, and raw)."""
    pc = count_params(model_cfg)
    lines = [(name, n) for name, n in pc.breakdown.items()]
    summary = [("total", pc.total)]
    if pc.breakdown["mtp"]:
        summary.append(("total without MTP", pc.main))
    summary += [
        ("active/token", pc.active),
        ("active/token without input embedding", pc.active_without_input_embedding),
        ("embedding", pc.embedding),
    ]
    width = max(len(name) for name, _ in lines + summary + [("paper units (2^30)", 0)])
    raw_width = len(f"{pc.total:,}")

    def row(name: str, n: int) -> str:
        return f"{name:<{width}}  {format_count(n):>10}  {n:>{raw_width},}"

    rule = "-" * (width + 14 + raw_width)
    out = [f"{'component':<{width}}  {'size':>10}  {'count':>{raw_width}}", rule]
    out += [row(name, n) for name, n in lines]
    out.append(rule)
    out += [row(name, n) for name, n in summary]
    units = paper_units(model_cfg)
    out.append(f"{'paper units (2^30)':<{width}}  {f'{units:.2f}' if units >= 0.01 else f'{units:.2e}':>10}")
    return "\n".join(out)
