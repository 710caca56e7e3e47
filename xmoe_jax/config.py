"""Typed, validated configuration.

One frozen dataclass per component; each validates itself on construction and
raises `ConfigError` naming the field and the fix. `load_config` reads a YAML
file (nested mappings mirror the dataclasses) and applies dotted overrides such
as ``model.moe.top_k=4``. Unknown keys and wrong types are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import signal
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Dispatch = Literal["dense", "padded", "pft", "rbd"]
Transport = Literal["auto", "bucketed", "ragged", "emulated"]
Overlap = Literal["none", "shared", "chunks", "both"]
XlaScheduler = Literal["default", "latency_hiding"]
Activation = Literal["swiglu", "gelu"]
ScoreFunc = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]
AuxLossType = Literal["micro_batch", "sequence", "none"]
DType = Literal["bfloat16", "float32", "float16"]
ParamDType = Literal["float32", "bfloat16"]
StateDType = Literal["float32", "bfloat16"]
DataSource = Literal["auto", "synthetic", "text", "files", "hf", "arrayrecord", "megatron"]
AttentionImpl = Literal["auto", "cudnn", "pallas", "xla"]
RematMode = Literal[
    "none",
    "full",
    "save_dots",
    "save_attention_and_experts",
    "save_sublayer_outputs",
    "save_exchange",
    "offload_experts",
]
NanPolicy = Literal["stop", "skip"]
QKNorm = Literal["none", "head", "full"]
AttentionType = Literal["mha", "mla"]
RopeScalingType = Literal["yarn"]
FP8Recipe = Literal["tensorwise", "rowwise", "blockwise"]
FP8Format = Literal["e4m3", "e5m2"]

DISPATCH_MODES = typing.get_args(Dispatch)
TRANSPORTS = typing.get_args(Transport)

# keys that describe placement, not the model: moved from model(.moe) to `parallel`
MOVED_TO_PARALLEL = {
    "model.moe.dispatch": "parallel.dispatch",
    "model.moe.transport": "parallel.transport",
    "model.moe.recv_buffer_factor": "parallel.recv_buffer_factor",
    "model.moe.ssmb": "parallel.ssmb",
    "model.moe.expert_tensor_parallel": "parallel.expert_tensor_parallel",
    "model.moe.auto_shard": "parallel.auto_shard",
    "model.sequence_parallel": "parallel.sequence_parallel",
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def stop_signal_names(text: str) -> list[str]:
    """`train.stop_signals` ("SIGTERM,INT,...", "" = none) as signal names; ConfigError if one is not
    a signal a process can catch."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    names = [n if n.startswith("SIG") else f"SIG{n}" for n in names]
    for n in names:
        _check(
            n in signal.Signals.__members__ and n not in ("SIGKILL", "SIGSTOP"),
            f"train.stop_signals: {n} is not a signal a process can catch; list names such as "
            "SIGTERM,SIGINT,SIGUSR1 (or '' for none)",
        )
    return names


def _check_choices(obj: Any, prefix: str) -> None:
    """Every `Literal`-typed field of a config dataclass holds one of its values."""
    for name, tp in typing.get_type_hints(type(obj)).items():
        base, _ = _resolve_type(tp)
        value = getattr(obj, name)
        if typing.get_origin(base) is Literal and value is not None:
            choices = typing.get_args(base)
            _check(value in choices, f"{prefix}{name}={value!r} is not one of {list(choices)}")


# Numeric fields: every float must be finite, and every number at least its lower bound, which is
# 1 for ints and 0 for floats unless listed here as (bound, strict). Runs after each component's own
# checks (whose messages are more specific) and catches the rest: head_dim=0, rope_theta=-1, a NaN
# init_std, capacity_factor=.inf, lr=inf.
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "MoEConfig.num_shared_experts": (0, False),
    "ModelConfig.num_dense_layers": (0, False),
    "ModelConfig.mtp_depth": (0, False),
    "ModelConfig.loss_chunk": (0, False),
    "MeshConfig.data": (-1, False),
    "OptimizerConfig.warmup_steps": (0, False),
    "TrainConfig.seed": (0, False),
    "DataConfig.seed": (0, False),
    "EvalConfig.every": (0, False),
    "ModelConfig.rope_theta": (0, True),
    "ModelConfig.norm_eps": (0, True),
    "ModelConfig.init_std": (0, True),
    "MoEConfig.routed_scaling_factor": (0, True),
    "OptimizerConfig.lr": (0, True),
    "OptimizerConfig.eps": (0, True),
    "TrainConfig.peak_tflops": (0, True),
}


def _check_numbers(obj: Any, prefix: str) -> None:
    """Every int / float field of a config dataclass is finite and within its `_LOWER_BOUNDS`."""
    for name, tp in typing.get_type_hints(type(obj)).items():
        base, _ = _resolve_type(tp)
        value = getattr(obj, name)
        if base not in (int, float) or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        _check(math.isfinite(value), f"{prefix}{name}={value!r} must be a finite number")
        default = (1, False) if base is int else (0, False)
        bound, strict = _LOWER_BOUNDS.get(f"{type(obj).__name__}.{name}", default)
        _check(
            value > bound if strict else value >= bound,
            f"{prefix}{name}={value!r} must be {'>' if strict else '>='} {bound}",
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
class ParallelConfig:
    """How the model is placed on the mesh: nothing here changes the parameters, so a checkpoint
    resumes under any of these settings (train with rbd, resume with pft).

    dispatch: how routed tokens reach their experts (moe/dispatchers.py): `dense` (the oracle),
      `padded` (capacity baseline), `pft` (padding-free), `rbd` (two-stage, across nodes).
    transport: the pft/rbd exchange (moe/exchange.py, moe/layouts.py): `bucketed` (dense
      all-to-all of per-peer chunks sized by the buffer factor), `ragged` (ragged_all_to_all),
      `emulated` (its exact emulation, the CPU default); `auto` = bucketed on GPU.
    recv_buffer_factor: pft/rbd receive buffers hold factor x the average routed rows (None =
      the worst case). With adaptive_buffers this is where the trainer starts (None: 1.25).
    adaptive_buffers: dropless pft/rbd training sizes the buffers itself (train/buffers.py): a
      step whose copies do not fit is not applied and reruns with the next size of a small
      ladder up to the worst case; after `buffer_shrink_after` quiet steps it steps back down.
    overlap_chunks: pft/rbd split the block's tokens into this many chunks, each dispatched on
      its own, so one chunk's exchange can run while another's experts compute.
    overlap: how pft/rbd order the block so its all-to-alls can run under GEMMs (moe/overlap.py,
      docs/exchange.md#overlap); the values are the same, only the program order changes.
      `shared`: the shared experts run inside the block between the dispatch and the combine
      exchanges (when mesh.tensor == 1; under TP they stay a column/row-split MLP after the block);
      `chunks`: the `overlap_chunks` chunks are software-pipelined (chunk i+1's dispatch is issued
      before chunk i's expert GEMMs; needs overlap_chunks >= 2); `both`; `none` (chunks, if any, in
      sequence).
    xla_scheduler: `latency_hiding` turns on XLA's latency-hiding scheduler on GPU (the flags of
      xla_flags.SCHEDULER_PRESETS, added by the CLI before JAX starts; flags already in XLA_FLAGS
      win), so async all-to-alls are overlapped with independent compute; `default`: XLA's own.
    ssmb: with tensor parallelism, each tensor rank routes, dispatches, computes and combines
      1/TP of the block's tokens (sequence-sharded MoE block); off, every tensor rank repeats the
      block on the same tokens. Off by default because it changes pft's capacity shards (drops are
      decided per data x expert x tensor shard); turn it on whenever mesh.tensor > 1.
    expert_tensor_parallel: each expert's hidden F split over the tensor axis, tokens replicated
      over it, partial outputs summed (the alternative to SSMB, for comparison).
    auto_shard: pft only: the padding-free algorithm on the whole batch under jit with logical
      sharding annotations only (no shard_map), leaving placement to XLA's partitioner.
    sequence_parallel: under tensor parallelism, also split the residual stream's sequence over
      the tensor axis between blocks (norms, residual adds).
    route_groups_by_node: group-limited routing (moe.num_groups, moe.topk_groups) is node-limited
      routing: group g is exactly the experts of expert node g (experts are numbered node-major),
      so a token's copies reach at most moe.topk_groups nodes. Needs moe.num_groups ==
      mesh.expert_nodes (checked against the mesh at start-up); rbd then sizes its cross-node
      send buffer by topk_groups pilots per token instead of min(top_k, nodes) and reports the
      most nodes any token reached (`max_nodes_per_token`).
    ragged_decomposed: a fact, not a choice: whether XLA rewrites the ragged all-to-all into a dense
      one (the `decomposer` preset took effect), so `wire_bytes` counts whole receive buffers.
      xmoe_jax/resolve.py sets it at start-up from the flags the backend started with; moe/ reads it
      instead of the process's XLA flags. A value written in a config is replaced there.
    """

    dispatch: Dispatch = "dense"
    transport: Transport = "auto"
    recv_buffer_factor: float | None = None
    adaptive_buffers: bool = True
    buffer_shrink_after: int = 200
    overlap_chunks: int = 1
    overlap: Overlap = "none"
    xla_scheduler: XlaScheduler = "default"
    ssmb: bool = False
    expert_tensor_parallel: bool = False
    auto_shard: bool = False
    sequence_parallel: bool = False
    route_groups_by_node: bool = False
    ragged_decomposed: bool = False

    def __post_init__(self) -> None:
        p = "parallel."
        _check_choices(self, p)
        if self.recv_buffer_factor is not None:
            _check(
                self.recv_buffer_factor > 0,
                f"{p}recv_buffer_factor={self.recv_buffer_factor} must be > 0 (or null for the worst case)",
            )
        _check(
            self.buffer_shrink_after >= 1, f"{p}buffer_shrink_after={self.buffer_shrink_after} must be >= 1"
        )
        _check(self.overlap_chunks >= 1, f"{p}overlap_chunks={self.overlap_chunks} must be >= 1")
        if self.overlap != "none":
            _check(
                self.dispatch in ("pft", "rbd") and not self.auto_shard,
                f"{p}overlap={self.overlap!r} orders pft/rbd's exchange inside the block's shard_map "
                f"(dispatch={self.dispatch!r}{', auto_shard' if self.auto_shard else ''}); set "
                f"{p}dispatch=pft or rbd (auto_shard=false), or {p}overlap=none",
            )
        _check(
            self.overlap not in ("chunks", "both") or self.overlap_chunks >= 2,
            f"{p}overlap={self.overlap!r} pipelines the block's chunks but {p}overlap_chunks="
            f"{self.overlap_chunks}; set {p}overlap_chunks=2 (or more), or {p}overlap=shared/none",
        )
        _check(
            not (self.ssmb and self.expert_tensor_parallel),
            f"{p}ssmb and {p}expert_tensor_parallel are alternatives (SSMB splits the tokens over the "
            "tensor axis, expert-TP splits each expert's hidden over it); set one of them to false",
        )
        _check(
            not self.auto_shard or self.dispatch == "pft",
            f"{p}auto_shard applies to dispatch='pft' ({self.dispatch!r} is always placed by XLA's "
            f"partitioner); set {p}auto_shard=false",
        )
        _check_numbers(self, p)


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

    recipe: FP8Recipe = "blockwise"
    grad_format: FP8Format = "e4m3"
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
    # FP8 GEMMs (xmoe_jax/fp8): null = off; {recipe: blockwise|rowwise|tensorwise, ...} = FP8Config
    fp8: FP8Config | None = None

    def __post_init__(self) -> None:
        p = "model."
        _check_choices(self, p)
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


class MeshShape(NamedTuple):
    """Resolved mesh sizes (sharding.py names the axes they become)."""

    data: int
    expert_nodes: int
    expert_per_node: int
    tensor: int

    @property
    def expert(self) -> int:
        return self.expert_nodes * self.expert_per_node

    @property
    def batch_shards(self) -> int:
        """How many shards the batch is split into: data x expert."""
        return self.data * self.expert


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data x expert x tensor. `data=-1` takes the remaining devices.

    `expert` is the expert-parallel degree; `expert_nodes` factors it into nodes x
    devices per node (node-major) for RBD, whose stage 1 crosses nodes and stage 2
    stays inside one. A single host can stand in for several nodes.
    """

    data: int = -1
    expert: int = 1
    tensor: int = 1
    expert_nodes: int = 1
    fsdp: bool = False  # also shard parameters and optimizer state over `data`

    def __post_init__(self) -> None:
        _check(self.data == -1 or self.data >= 1, f"mesh.data={self.data} must be >= 1 or -1 (fill)")
        _check(self.expert >= 1, f"mesh.expert={self.expert} must be >= 1")
        _check(self.tensor >= 1, f"mesh.tensor={self.tensor} must be >= 1")
        _check(
            self.expert_nodes >= 1 and self.expert % self.expert_nodes == 0,
            f"mesh.expert_nodes={self.expert_nodes} must divide mesh.expert={self.expert} "
            "(devices per node = expert / expert_nodes)",
        )
        _check_numbers(self, "mesh.")

    def resolve(self, num_devices: int) -> MeshShape:
        """Axis sizes for `num_devices`; errors if they cannot multiply to it."""
        fixed = self.expert * self.tensor
        if self.data == -1:
            _check(
                num_devices % fixed == 0,
                f"mesh.expert * mesh.tensor = {fixed} does not divide the {num_devices} devices; "
                "choose sizes whose product divides the device count",
            )
            data = num_devices // fixed
        else:
            data = self.data
            _check(
                data * fixed == num_devices,
                f"mesh size data*expert*tensor = {data}*{self.expert}*{self.tensor} = {data * fixed} "
                f"!= {num_devices} devices; set mesh.data=-1 or sizes whose product is {num_devices}",
            )
        return MeshShape(data, self.expert_nodes, self.expert // self.expert_nodes, self.tensor)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr` (train/optimizer.py: the
    update, which parameters are decayed). `state_dtype` stores the two moments in float32 or
    bfloat16 (half their bytes; each step still computes in float32)."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    decay_steps: int | None = None  # None = train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    state_dtype: StateDType = "float32"

    def __post_init__(self) -> None:
        _check_choices(self, "optimizer.")
        _check(self.lr > 0, f"optimizer.lr={self.lr} must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio must be in [0, 1]")
        _check(self.warmup_steps >= 0, "optimizer.warmup_steps must be >= 0")
        _check(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "optimizer.b1 and b2 must be in [0, 1)")
        _check(self.weight_decay >= 0, "optimizer.weight_decay must be >= 0")
        if self.grad_clip is not None:
            _check(self.grad_clip > 0, "optimizer.grad_clip must be > 0 (or null for no clipping)")
        _check_numbers(self, "optimizer.")


@dataclass(frozen=True)
class SourceConfig:
    """One dataset: where it is and how to read it (`xmoe_jax/data/sources.py` opens each kind).

    source: `auto` (detected from `path`: none = synthetic), `synthetic`, `text` (one file, one
      token stream, no end-of-document marks), `files` (a folder or glob of .txt / .jsonl /
      .parquet: every file, line or row a document), `hf` (a `datasets` save_to_disk directory
      or .arrow files), `arrayrecord` (shards written by xmoe-tokenize), `megatron` (.bin + .idx).
    text_field: the text column of jsonl / parquet / hf documents.
    split: the split of a saved `datasets.DatasetDict`.
    weight: share of a mixture (relative; normalised over the mixture).
    """

    source: DataSource = "auto"
    path: str | None = None
    text_field: str = "text"
    split: str = "train"
    weight: float = 1.0

    def check(self, prefix: str) -> None:
        """Validation with the caller's prefix (`data.`, `data.mixture[2].`, `eval.data.`)."""
        _check_choices(self, prefix)
        if self.source not in ("auto", "synthetic"):
            _check(self.path is not None, f"{prefix}source={self.source!r} needs {prefix}path=<location>")
        _check(
            not (self.source == "synthetic" and self.path is not None),
            f"{prefix}source='synthetic' reads no {prefix}path={self.path!r}; set {prefix}source=auto "
            "(detected from the path) or name the kind",
        )
        _check(self.weight > 0, f"{prefix}weight={self.weight} must be > 0")
        _check(bool(self.text_field), f"{prefix}text_field must name the text column, e.g. 'text'")
        _check_numbers(self, prefix)


@dataclass(frozen=True)
class DataConfig:
    """Training input: one source (`source`, `path`, ...) or a weighted `mixture` of sources,
    tokenized with `tokenizer` (`bytes`, a tokenizer.json, a transformers tokenizer directory or a
    sentencepiece .model) and packed into windows of seq_len + 1 tokens. `auto` (the default) is the
    tokenizer xmoe-tokenize recorded with pre-tokenized data, else `bytes`
    (`xmoe_jax/data/provenance.py` resolves it before training)."""

    source: DataSource = "auto"
    path: str | None = None
    text_field: str = "text"
    split: str = "train"
    mixture: tuple[SourceConfig, ...] = ()
    tokenizer: str = "auto"
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        _check_choices(self, "data.")
        _check(
            bool(self.tokenizer), "data.tokenizer must be 'auto', 'bytes' or a tokenizer file or directory"
        )
        if self.mixture:
            _check(
                self.source == "auto" and self.path is None,
                "data.mixture and data.source/data.path are alternatives; move the single source into "
                "the mixture list (data.mixture: [{path: ..., weight: ...}, ...])",
            )
        for i, src in enumerate(self.mixture):
            src.check(f"data.mixture[{i}].")
        if not self.mixture:
            self.sources[0].check("data.")
        _check_numbers(self, "data.")

    @property
    def sources(self) -> tuple[SourceConfig, ...]:
        """The mixture, or the single source as a mixture of one."""
        if self.mixture:
            return self.mixture
        return (SourceConfig(self.source, self.path, self.text_field, self.split),)

    @property
    def byte_level(self) -> bool:
        """Text is read as bytes (256 ids): the model needs vocab_size >= 256. Sources whose kind
        is detected from the path (`auto`) are checked when they are opened."""
        return self.tokenizer in ("bytes", "auto") and any(
            s.source in ("text", "files", "hf") for s in self.sources
        )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: every `every` steps (0 = never during training; `xmoe-eval` still
    works), `steps` batches of train.batch_size from the same start each time, on the last
    `holdout` fraction of every training source (taken out of training) or on `data`."""

    every: int = 0
    steps: int = 10
    holdout: float = 0.0
    data: SourceConfig | None = None

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"eval.every={self.every} must be >= 0 (0 = no evaluation during training)")
        _check(self.steps >= 1, f"eval.steps={self.steps} must be >= 1")
        _check(0 <= self.holdout < 1, f"eval.holdout={self.holdout} must be in [0, 1) (a fraction)")
        _check(
            not (self.holdout > 0 and self.data is not None),
            "eval.holdout and eval.data are alternatives (a held-out split of the training data, or "
            "another dataset); set one of them",
        )
        if self.data is not None:
            self.data.check("eval.data.")
        _check(
            self.every == 0 or self.holdout > 0 or self.data is not None,
            f"eval.every={self.every} needs eval data: set eval.holdout (e.g. 0.01) or eval.data.path",
        )
        _check_numbers(self, "eval.")

    @property
    def has_data(self) -> bool:
        return self.holdout > 0 or self.data is not None


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under `<run_dir>/checkpoints`."""

    enabled: bool = True
    every: int = 100
    keep: int = 3
    async_save: bool = True

    def __post_init__(self) -> None:
        _check(self.every >= 1, f"checkpoint.every={self.every} must be >= 1")
        _check(self.keep >= 1, f"checkpoint.keep={self.keep} must be >= 1")
        _check_numbers(self, "checkpoint.")


@dataclass(frozen=True)
class TrainConfig:
    """The loop: steps, global batch, sequence length, logging, NaN handling, stop signals."""

    steps: int = 100
    batch_size: int = 8  # global, in sequences
    seq_len: int = 64
    seed: int = 0
    log_every: int = 10
    # gradient accumulation: sequences per micro-batch (global); None = the whole batch at once
    micro_batch_size: int | None = None
    run_dir: str = "runs/default"
    nan_policy: NanPolicy = "stop"
    peak_tflops: float | None = None  # per device; None = look up by device kind
    tensorboard: bool = True  # event files under <run_dir>/tensorboard
    profile_steps: tuple[int, int] | None = None  # jax.profiler trace of steps [first, last]
    stop_signals: str = "SIGTERM,SIGINT,SIGUSR1"  # finish the step, save, exit 75 (train/preemption.py)

    def __post_init__(self) -> None:
        _check(self.steps >= 1, f"train.steps={self.steps} must be >= 1")
        if self.profile_steps is not None:
            first, last = self.profile_steps
            _check(
                1 <= first <= last,
                f"train.profile_steps={list(self.profile_steps)} must be [first, last] with 1 <= first <= last",
            )
        _check(self.batch_size >= 1, f"train.batch_size={self.batch_size} must be >= 1")
        _check(self.seq_len >= 1, f"train.seq_len={self.seq_len} must be >= 1")
        _check(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        if self.micro_batch_size is not None:
            _check(
                self.micro_batch_size >= 1 and self.batch_size % self.micro_batch_size == 0,
                f"train.micro_batch_size={self.micro_batch_size} must divide train.batch_size={self.batch_size}",
            )
        stop_signal_names(self.stop_signals)
        _check_choices(self, "train.")
        _check_numbers(self, "train.")


@dataclass(frozen=True)
class Config:
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check(
            self.train.seq_len <= self.model.max_seq_len,
            f"train.seq_len={self.train.seq_len} > model.max_seq_len={self.model.max_seq_len}",
        )
        if self.data.byte_level:
            _check(
                self.model.vocab_size >= 256,
                f"data.tokenizer='bytes' reads 256 byte ids but model.vocab_size={self.model.vocab_size}; "
                "set model.vocab_size >= 256",
            )
        moe = self.model.moe
        _check(
            moe is not None or not self.parallel.route_groups_by_node,
            "parallel.route_groups_by_node needs MoE layers (model.moe); set it to false",
        )
        if moe is not None:
            _check(
                moe.num_experts % self.mesh.expert == 0,
                f"moe.num_experts={moe.num_experts} is not divisible by mesh.expert={self.mesh.expert}; "
                "choose an expert axis that divides the expert count",
            )
            if self.parallel.route_groups_by_node:
                check_groups_by_node(moe, self.mesh.expert_nodes)
            if self.parallel.expert_tensor_parallel:
                _check(
                    moe.expert_hidden % self.mesh.tensor == 0,
                    f"moe.expert_hidden={moe.expert_hidden} is not divisible by mesh.tensor={self.mesh.tensor}; "
                    "parallel.expert_tensor_parallel splits it over the tensor axis",
                )

    def validate_for_devices(self, num_devices: int, num_processes: int = 1) -> MeshShape:
        """Checks that need the runtime: mesh size and batch divisibility."""
        shape = self.mesh.resolve(num_devices)
        shards, tensor = shape.batch_shards, shape.tensor
        _check(
            self.train.batch_size % shards == 0,
            f"train.batch_size={self.train.batch_size} is not divisible by data*expert={shards} "
            "batch shards; use a multiple",
        )
        micro = self.train.micro_batch_size
        _check(
            micro is None or micro % shards == 0,
            f"train.micro_batch_size={micro} is not divisible by data*expert={shards} batch shards; "
            "every micro-batch is split over all of them: use a multiple",
        )
        if self.parallel.sequence_parallel:
            _check(
                self.train.seq_len % tensor == 0,
                f"train.seq_len={self.train.seq_len} is not divisible by mesh.tensor={tensor}; "
                "parallel.sequence_parallel splits each sequence over the tensor axis",
            )
        if self.model.moe is not None and self.parallel.ssmb:
            local_tokens = (micro or self.train.batch_size) // shards * self.train.seq_len
            _check(
                local_tokens % tensor == 0,
                f"parallel.ssmb: the {local_tokens} tokens per data*expert shard are not divisible by "
                f"mesh.tensor={tensor}; choose train.seq_len or train.batch_size so they are",
            )
        _check(
            self.train.batch_size % num_processes == 0,
            f"train.batch_size={self.train.batch_size} is not divisible by {num_processes} processes",
        )
        return shape


def check_groups_by_node(moe: MoEConfig, expert_nodes: int) -> None:
    """parallel.route_groups_by_node: routing groups are expert nodes one to one."""
    _check(
        moe.num_groups == expert_nodes,
        f"parallel.route_groups_by_node: moe.num_groups={moe.num_groups} must equal the expert nodes "
        f"(mesh.expert_nodes={expert_nodes}) so that group g is node g's experts; set mesh.expert_nodes="
        f"{moe.num_groups} or parallel.route_groups_by_node=false",
    )


# ----------------------------------------------------------------------------- loading


def _resolve_type(tp: Any) -> tuple[Any, bool]:
    """(base type, optional) for the annotations used above."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(path: str, tp: Any, value: Any) -> Any:
    base, optional = _resolve_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path} may not be null")
    if dataclasses.is_dataclass(base):
        if isinstance(value, base):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {type(value).__name__}")
        return _build(base, value, path + ".")
    if typing.get_origin(base) is tuple:
        return _coerce_tuple(path, base, value)
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value not in choices:
            raise ConfigError(f"{path}={value!r} is not one of {list(choices)}")
        return value
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(f"{path} must be {base.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _coerce_tuple(path: str, tp: Any, value: Any) -> tuple:
    """`tuple[X, ...]` (any length) or `tuple[X, Y]` (fixed) from a YAML list."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path} must be a list, got {value!r} ({type(value).__name__})")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        types_ = [args[0]] * len(value)
    else:
        if len(value) != len(args):
            raise ConfigError(f"{path} must have {len(args)} entries, got {len(value)}")
        types_ = list(args)
    return tuple(_coerce(f"{path}[{i}]", t, v) for i, (t, v) in enumerate(zip(types_, value, strict=True)))


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for key in unknown:
        moved = MOVED_TO_PARALLEL.get(prefix + key)
        if moved is not None:
            raise ConfigError(
                f"{prefix}{key} moved to {moved} (it says how the model is placed, not what it is); "
                f"write {moved}={data[key]} (a top-level '{moved.split('.')[0]}:' section in YAML) instead"
            )
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; valid keys under "
            f"'{prefix.rstrip('.') or '<top>'}' are {sorted(names)}"
        )
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def from_dict(data: dict, cls: type = Config) -> Any:
    """Builds a (nested) config dataclass from plain data, validating keys and types."""
    return _build(cls, data or {})


def migrate_dict(data: dict) -> dict:
    """A config dict as older versions wrote it (checkpoints) in today's layout: placement keys
    that lived under model(.moe) move to `parallel`. Returns a new dict; `data` is untouched."""
    out = json.loads(json.dumps(data))
    for old, new in MOVED_TO_PARALLEL.items():
        *parents, leaf = old.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            value = node.pop(leaf)
            section, key = new.split(".")
            out.setdefault(section, {}).setdefault(key, value)
    return out


def _plain(value: Any) -> Any:
    """Lists for tuples, recursively: what JSON and YAML read back."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def to_dict(cfg: Any) -> dict:
    """Plain data (dicts, lists, scalars) that `from_dict` turns back into `cfg`."""
    return _plain(dataclasses.asdict(cfg))


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """`key=value` strings -> (dotted key, YAML-parsed value)."""
    from xmoe_jax import config_yaml  # imports ConfigError from here

    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        out.append((key.strip(), config_yaml.parse_value(key.strip(), raw)))
    return out


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] | None = None) -> Config:
    """Reads `path` (YAML; None = built-in defaults) and applies dotted overrides."""
    from xmoe_jax import config_yaml  # imports ConfigError from here

    data: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass --config configs/<name>.yaml")
        data = config_yaml.load_file(p) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    return from_dict(override_dict(data, overrides))


def override_dict(data: dict, overrides: list[str] | None) -> dict:
    """`data` (a config as plain data) with dotted `key=value` overrides applied, in place."""
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    return data
