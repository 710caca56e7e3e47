"""The peer shape: one xmoe_jax config (configs/tiny_small_shape.yaml) read as plain YAML, and what
MaxText and torchtitan are given for it.

Read without importing xmoe_jax or JAX, so the torch process (torchtitan) can use it too.

The peers' experts are gated (SwiGLU, three matrices) where ours use GELU (two matrices); they get
the hidden size of equal FLOPs, 2F/3 rounded up to a multiple of 64: 3 x 2048 x 960 against
2 x 2048 x 1408 (+2.3% expert FLOPs, +0.9% of the step's model FLOPs). MFU uses the repo's formula
on the repo's config for every system (scripts/peers/table.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import yaml


@dataclasses.dataclass(frozen=True)
class PeerShape:
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    top_k: int
    expert_hidden: int  # ours (GELU, two matrices)
    aux_loss_weight: float
    seq_len: int
    batch_size: int
    lr: float
    weight_decay: float
    grad_clip: float

    @property
    def gated_expert_hidden(self) -> int:
        """Equal-FLOP hidden size for three-matrix (gated) experts."""
        return 64 * math.ceil(2 * self.expert_hidden / 3 / 64)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def load_shape(path: str | Path) -> PeerShape:
    """The shape fields of an xmoe_jax config file; errors name the field and the fix."""
    raw = yaml.safe_load(Path(path).read_text())
    model, moe, train, opt = raw["model"], raw["model"].get("moe"), raw["train"], raw.get("optimizer", {})
    if not moe:
        raise SystemExit(f"{path}: model.moe is missing; the peer harness compares MoE models only")
    if model.get("num_dense_layers", 0):
        raise SystemExit(
            f"{path}: model.num_dense_layers must be 0 for the peer harness (peers run MoE in every layer)"
        )
    if moe.get("capacity_factor") is not None or moe.get("num_shared_experts", 0):
        raise SystemExit(
            f"{path}: set model.moe.capacity_factor: null and num_shared_experts: 0 (peers run dropless, no shared)"
        )
    return PeerShape(
        hidden=model["hidden"],
        num_layers=model["num_layers"],
        num_heads=model["num_heads"],
        num_kv_heads=model.get("num_kv_heads") or model["num_heads"],
        head_dim=model.get("head_dim") or model["hidden"] // model["num_heads"],
        vocab_size=model["vocab_size"],
        num_experts=moe["num_experts"],
        top_k=moe["top_k"],
        expert_hidden=moe["expert_hidden"],
        aux_loss_weight=moe.get("aux_loss_weight", 0.0),
        seq_len=train["seq_len"],
        batch_size=train["batch_size"],
        lr=opt.get("lr", 3e-4),
        weight_decay=opt.get("weight_decay", 0.1),
        grad_clip=opt.get("grad_clip", 1.0),
    )


def maxtext_overrides(s: PeerShape, batch_size: int | None = None) -> list[str]:
    """MaxText 0.2.5 key=value overrides for the shape (base.yml keys; the `mixtral` decoder block:
    MHA through num_kv_heads = num_heads, RoPE, no qk-norm, an MoE in every layer)."""
    return [
        "decoder_block=mixtral",
        f"base_emb_dim={s.hidden}",
        f"base_num_query_heads={s.num_heads}",
        f"base_num_kv_heads={s.num_kv_heads}",
        f"head_dim={s.head_dim}",
        f"base_mlp_dim={s.gated_expert_hidden}",
        f"base_moe_mlp_dim={s.gated_expert_hidden}",
        f"base_num_decoder_layers={s.num_layers}",
        f"num_experts={s.num_experts}",
        f"num_experts_per_tok={s.top_k}",
        f"vocab_size={s.vocab_size}",
        f"max_target_length={s.seq_len}",
        f"per_device_batch_size={batch_size or s.batch_size}",
        f"load_balance_loss_weight={s.aux_loss_weight}",
        f"learning_rate={s.lr}",
        f"adam_weight_decay={s.weight_decay}",
        f"gradient_clipping_threshold={s.grad_clip}",
        "opt_type=adamw",
        "dtype=bfloat16",
        "weight_dtype=float32",
        "enable_dropout=false",
        "scan_layers=false",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        "capacity_factor=-1",  # dropless
    ]
