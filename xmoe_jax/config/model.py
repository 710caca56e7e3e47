"""What the model is: the transformer, its MoE layers, attention variants (MLA, YaRN) and FP8.
Nothing here says how it is placed on devices (`parallel.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xmoe_jax.config.checks import _check, _check_choices, _check_numbers
from xmoe_jax.config.choices import (
    Activation,
    AttentionImpl,
    AttentionType,
    AuxLossType,
    DropPolicy,
    DType,
    FP8Format,
    FP8Recipe,
    ParamDType,
    QKNorm,
    RematMode,
    RopeScalingType,
    ScoreFunc,
)


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts and router of one MoE layer: what the layer computes, not how it is placed
    (the dispatch mode and placement are `ParallelConfig`)."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    num_shared_experts: int = 0
    shared_expert_hidden: int | None = None  # default: num_shared_experts * expert_hidden
    activation: Activation = "swiglu"
    score_func: ScoreFunc = "softmax"
    norm_topk_prob: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = False
    capacity_factor: float | None = None  # None = dropless
    drop_policy: DropPolicy = "probs"
    aux_loss_type: AuxLossType = "micro_batch"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    bias_update_rate: float = 0.0  # aux-loss-free balancing (sigmoid routing)
    # benchmarking only (the vendors' tables): token t's copies go to experts (t*K + j) mod E, so every
    # expert gets the same count; the combine weights are still the router's scores at those experts
    # (router.py). Not a model anyone would train: label any number measured with it.
    force_balance: bool = False

    def __post_init__(self) -> None:
        p = "moe."
        _check_choices(self, p)
        _check(self.num_experts >= 1, f"{p}num_experts={self.num_experts} must be >= 1")
        _check(
            1 <= self.top_k <= self.num_experts,
            f"{p}top_k={self.top_k} must be in [1, num_experts={self.num_experts}]",
        )
        _check(self.expert_hidden >= 1, f"{p}expert_hidden must be >= 1")
        _check(self.num_shared_experts >= 0, f"{p}num_shared_experts must be >= 0")
        if self.shared_expert_hidden is not None:
            _check(self.shared_expert_hidden >= 1, f"{p}shared_expert_hidden must be >= 1")
        _check(
            self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
            f"{p}num_groups={self.num_groups} must divide num_experts={self.num_experts}",
        )
        _check(
            1 <= self.topk_groups <= self.num_groups,
            f"{p}topk_groups={self.topk_groups} must be in [1, num_groups={self.num_groups}]",
        )
        if self.num_groups > 1:
            _check(
                self.score_func == "sigmoid",
                f"{p}num_groups > 1 (group-limited routing) needs score_func='sigmoid'",
            )
            per_group = self.num_experts // self.num_groups
            _check(
                self.topk_groups * per_group >= self.top_k,
                f"{p}topk_groups * experts per group = {self.topk_groups * per_group} "
                f"< top_k={self.top_k}; raise topk_groups",
            )
        if self.capacity_factor is not None:
            _check(
                self.capacity_factor > 0,
                f"{p}capacity_factor={self.capacity_factor} must be > 0 (or null for dropless)",
            )
        _check(self.bias_update_rate >= 0, f"{p}bias_update_rate must be >= 0")
        _check_numbers(self, "model.moe.")

    @property
    def shared_hidden(self) -> int:
        """Hidden size of the (fused) shared-expert MLP; 0 when there is none."""
        if self.num_shared_experts == 0:
            return 0
        if self.shared_expert_hidden is not None:
            return self.shared_expert_hidden
        return self.num_shared_experts * self.expert_hidden

    @property
    def has_router_bias(self) -> bool:
        """The selection-only correction bias exists for sigmoid routing."""
        return self.score_func == "sigmoid"

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity C = ceil(cf * T * k / E) (needs capacity_factor)."""
        cf = self.capacity_factor if self.capacity_factor is not None else 1.0
        return max(1, math.ceil(cf * num_tokens * self.top_k / self.num_experts))


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, model/mla.py): every head's keys and values are
    expanded from one compressed latent per token, which is all the KV cache keeps.

    kv_lora_rank: C, the latent's size (RMS-normed before the expansion).
    q_lora_rank: queries through a low-rank latent of this size with its own norm (V3: 1536);
      None: one full query projection (V2-Lite).
    qk_nope_head_dim: N, per-head query/key dims without position information.
    qk_rope_head_dim: R, per-head query dims under RoPE; the key's R RoPE dims are one vector
      shared by all heads. A head's query/key has N + R dims, its value `v_head_dim` (U).
    rope_interleave: RoPE rotates adjacent pairs of dims (DeepSeek's checkpoints) instead of the
      two halves.
    """

    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        p = "model.mla."
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check(getattr(self, name) >= 1, f"{p}{name}={getattr(self, name)} must be >= 1")
        _check(
            self.q_lora_rank is None or self.q_lora_rank >= 1,
            f"{p}q_lora_rank={self.q_lora_rank} must be >= 1 (or null for a full query projection)",
        )
        _check(self.qk_rope_head_dim % 2 == 0, f"{p}qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        _check_numbers(self, p)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RopeScalingConfig:
    """YaRN RoPE scaling, as DeepSeek-V2/V3's config.json `rope_scaling` (model/rope.py): the rotary
    frequencies blend interpolation (divided by `factor`) and extrapolation between the dims that
    turn `beta_fast` and `beta_slow` times over `original_max_position_embeddings`; cos and sin are
    scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and MLA's softmax scale by
    mscale(factor, mscale_all_dim)^2, where mscale(s, m) = 0.1 m ln(s) + 1."""

    type: RopeScalingType = "yarn"
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        p = "model.rope_scaling."
        _check_choices(self, p)
        _check(self.factor >= 1, f"{p}factor={self.factor} must be >= 1")
        _check(
            self.original_max_position_embeddings >= 1,
            f"{p}original_max_position_embeddings must be >= 1",
        )
        _check(self.beta_fast > self.beta_slow > 0, f"{p}beta_fast must be > beta_slow > 0")
        _check_numbers(self, p)


@dataclass(frozen=True)
class FP8Config:
    """FP8 GEMMs with current scaling (xmoe_jax/fp8): `recipe` says which tiles share a scale
    (tensorwise, rowwise, or blockwise = DeepSeek-V3's 1x128 / 128x128), `grad_format` the output
    gradients' 8-bit format. `projections`: attention q/k/v/o and the dense and shared-expert MLPs;
    `experts`: the routed experts' grouped GEMMs (pft and rbd dispatch); `dispatch`: pft sends the
    routed rows in FP8 with 1x128 scales and dequantizes them on arrival. Embeddings, the LM head,
    the router, norms and attention scores stay in the compute dtype; parameters, optimizer state
    and checkpoints are unchanged, so a run resumes with FP8 switched on or off."""

    recipe: FP8Recipe = "rowwise"  # the fastest on an H100 (benchmarks/fp8.md); blockwise is DeepSeek-V3's
    grad_format: FP8Format = "e4m3"
    fast_accum: bool = False  # the grouped GEMM's K loop accumulates in the tensor core (fp8/recipe.py)
    projections: bool = True
    experts: bool = True
    dispatch: bool = False

    def __post_init__(self) -> None:
        p = "model.fp8."
        _check_choices(self, p)
        _check(
            self.projections or self.experts or self.dispatch,
            f"{p}projections, experts and dispatch are all false: set one true, or model.fp8=null for no FP8",
        )


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer: first `num_dense_layers` dense, the rest MoE."""

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # None = num_heads (MHA)
    head_dim: int | None = None  # None = hidden // num_heads
    dense_hidden: int = 256
    dense_activation: Activation = "swiglu"
    num_dense_layers: int = 1
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # attention variants of published models (HuggingFace import/export): bias on the q/k/v
    # projections (Qwen2); RMSNorm on q and k before RoPE, per head over K (Qwen3) or over the
    # whole projected width H*K / G*K (OLMoE); output head tied to the embedding (embed.T)
    qkv_bias: bool = False
    qk_norm: QKNorm = "none"
    tie_embeddings: bool = False
    # multi-head latent attention (DeepSeek-V2/V3) instead of MHA/GQA: `mla` holds its sizes
    attention_type: AttentionType = "mha"
    mla: MLAConfig | None = None
    rope_scaling: RopeScalingConfig | None = None  # null = plain RoPE
    # multi-token prediction (DeepSeek-V3, model/mtp.py): `mtp_depth` extra blocks, each predicting one
    # token further ahead, sharing the embedding and head; their mean loss is added times the weight
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    init_std: float = 0.02
    dtype: DType = "bfloat16"
    param_dtype: ParamDType = "float32"
    # attention backend (model/attention.py): auto = cuDNN on NVIDIA, Pallas on ROCm, XLA elsewhere
    attention: AttentionImpl = "auto"
    # activation checkpointing per block (xmoe_jax/remat.py has what each mode keeps)
    remat: RematMode = "none"
    # layers run as a scan over stacked parameters (compile time flat in depth); true = a Python loop
    unroll_layers: bool = False
    # layers per scan iteration (jax.lax.scan's unroll): compile time grows with it, not with depth;
    # the number of layers = straight-line code inside one iteration (fastest on GPU: benchmarks/scale.md)
    scan_unroll: int = 1
    # cross-entropy in chunks of this many sequence positions (never [B,S,V] float32 logits); 0 = whole
    loss_chunk: int = 128
    moe: MoEConfig | None = field(default_factory=MoEConfig)
    # FP8 GEMMs (xmoe_jax/fp8): null = off; {recipe: rowwise|blockwise|tensorwise, ...} = FP8Config
    fp8: FP8Config | None = None

    def __post_init__(self) -> None:
        p = "model."
        _check_choices(self, p)  # offload_experts: refused with its reason (choices.REMOVED)
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "dense_hidden", "max_seq_len"):
            _check(getattr(self, name) >= 1, f"{p}{name}={getattr(self, name)} must be >= 1")
        _check(
            0 <= self.num_dense_layers <= self.num_layers,
            f"{p}num_dense_layers={self.num_dense_layers} must be in [0, num_layers={self.num_layers}]",
        )
        if self.attention_type == "mla":
            _check(
                self.mla is not None,
                f"{p}attention_type='mla' needs the {p}mla section (kv_lora_rank, q_lora_rank, "
                "qk_nope_head_dim, qk_rope_head_dim, v_head_dim)",
            )
            _check(
                self.kv_heads == self.num_heads and not self.qkv_bias and self.qk_norm == "none",
                f"{p}attention_type='mla' has one key/value head per query head and its own norms: "
                "leave num_kv_heads, qkv_bias and qk_norm at their defaults",
            )
        else:
            _check(
                self.mla is None,
                f"{p}mla is set but attention_type={self.attention_type!r}; set {p}attention_type=mla "
                f"or {p}mla=null",
            )
            if self.head_dim is None:
                _check(
                    self.hidden % self.num_heads == 0,
                    f"{p}hidden={self.hidden} is not divisible by num_heads={self.num_heads}; set model.head_dim",
                )
            _check(
                self.kv_heads >= 1 and self.num_heads % self.kv_heads == 0,
                f"{p}num_kv_heads={self.kv_heads} must divide num_heads={self.num_heads}",
            )
            _check(self.head_size % 2 == 0, f"{p}head_dim={self.head_size} must be even for RoPE")
        _check(
            self.mtp_depth >= 0, f"{p}mtp_depth={self.mtp_depth} must be >= 0 (0 = no multi-token prediction)"
        )
        _check(self.mtp_loss_weight >= 0, f"{p}mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        _check(
            self.moe is not None or self.num_dense_layers == self.num_layers,
            f"{p}moe is null but num_dense_layers < num_layers; set num_dense_layers={self.num_layers}",
        )
        _check(self.loss_chunk >= 0, f"{p}loss_chunk={self.loss_chunk} must be >= 0 (0 = no chunking)")
        _check(self.scan_unroll >= 1, f"{p}scan_unroll={self.scan_unroll} must be >= 1")
        _check_numbers(self, p)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        """Per-head dims of MHA/GQA (MLA: the query/key dims N + R)."""
        if self.mla is not None:
            return self.mla.qk_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden // self.num_heads

    @property
    def value_head_size(self) -> int:
        """Per-head dims of the values (MLA: v_head_dim; else head_size)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_size

    @property
    def rope_dim(self) -> int:
        """Dims RoPE rotates per head (MLA: qk_rope_head_dim)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.moe is not None else 0
