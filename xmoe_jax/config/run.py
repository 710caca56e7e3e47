"""A training run: optimizer, checkpoints, the loop's settings, and `Config`, the whole of it, with
the checks that need more than one section. `Config` settles `parallel.dispatch: auto` for its model
(config/parallel.py), so nothing downstream sees `auto`."""

from __future__ import annotations

from dataclasses import dataclass, field

from xmoe_jax.config.checks import _check, _check_choices, _check_numbers
from xmoe_jax.config.choices import AccumDType, NanPolicy, StateDType
from xmoe_jax.config.data import DataConfig, EvalConfig
from xmoe_jax.config.model import ModelConfig, MoEConfig
from xmoe_jax.config.parallel import MeshConfig, MeshShape, ParallelConfig
from xmoe_jax.config.signals import stop_signal_names


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
    # the micro-batches' gradient sum: bfloat16 holds it in 2 bytes per parameter instead of 4 (each
    # micro-batch's gradient is rounded to bfloat16 as it is added; benchmarks/grad_accum_cpu.md has the curve)
    grad_accum_dtype: AccumDType = "float32"
    # keep the matrices the model casts to model.dtype at every use as copies in it, written by the
    # optimizer step (2 bytes more per parameter; the step reads and casts less: train/weight_copy.py)
    weight_copy: bool = True
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
    """Everything a training run needs. Built, its `parallel.dispatch` is settled for its model:
    `auto` is `pft` wherever there are routed experts (`ParallelConfig.settle`)."""

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
        object.__setattr__(self, "parallel", self.parallel.settle(has_experts=moe is not None))

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
        check_mesh_switches(self, shape.data)
        return shape


def check_mesh_switches(cfg: Config, data_devices: int) -> None:
    """The switches that need the resolved mesh (config/applies.py's table, row `mesh.fsdp`): FSDP
    over a data axis of one device shards nothing."""
    _check(
        not cfg.mesh.fsdp or data_devices > 1,
        f"mesh.fsdp=true shards parameters over the data axis, but it resolves to {data_devices} device "
        "here; set mesh.fsdp=false (or a data axis > 1)",
    )


def check_groups_by_node(moe: MoEConfig, expert_nodes: int) -> None:
    """parallel.route_groups_by_node: routing groups are expert nodes one to one."""
    _check(
        moe.num_groups == expert_nodes,
        f"parallel.route_groups_by_node: moe.num_groups={moe.num_groups} must equal the expert nodes "
        f"(mesh.expert_nodes={expert_nodes}) so that group g is node g's experts; set mesh.expert_nodes="
        f"{moe.num_groups} or parallel.route_groups_by_node=false",
    )
