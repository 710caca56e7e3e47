"""Switches that cannot apply: a value the run would accept but never read, so it trains exactly as
without it, is refused when the config is built, naming the reason and the fix (issue 31).

Each row below was checked against the code that reads the field. The refused rows are checked
here: `check_switches` from `loading.from_dict` (every config as written: YAML, `--set`, a run's
config.yaml; not the facts `resolve.py` fills in later), `check_mesh_switches` with the device
count from `Config.validate_for_devices`. The list after the table says why the rest stay accepted.

| switch                                   | read by                              | cannot apply when (refused)                  |
|------------------------------------------|--------------------------------------|----------------------------------------------|
| model.fp8.experts                        | moe/experts.py grouped/combined GEMMs | dispatch dense/padded (einsum experts), no MoE |
| model.fp8.dispatch                       | moe/pft.py exchange                  | no exchange: not pft/rbd, auto_shard, 1 expert device (rbd: 1 per node) |
| model.fp8.projections                    | model/layers.py, moe/experts.dense_mlp | MLA with no dense layer and no shared expert |
| parallel.transport (not auto)            | moe/transports.py, moe/layouts.py    | no exchange                                  |
| parallel.recv_buffer_factor (set)        | moe/pft.py recv_rows, train/buffers  | no exchange                                  |
| parallel.adaptive_buffers=false, buffer_shrink_after | moe/ladder.applies       | no exchange, or capacity_factor set (drops)  |
| parallel.overlap_chunks > 1              | moe/dispatchers._in_chunks           | not pft/rbd inside shard_map (auto_shard)    |
| parallel.overlap                         | moe/overlap.py                       | (ParallelConfig: not pft/rbd)                |
| parallel.ssmb, sequence_parallel, expert_tensor_parallel | sharding rules       | mesh.tensor == 1; ssmb/etp without MoE       |
| parallel.route_groups_by_node            | moe/rbd.py (pilot sizing)            | dispatch is not rbd                          |
| mesh.fsdp                                | sharding.param_rules                 | the data axis resolves to 1 device           |
| moe.shared_expert_gate, shared_expert_hidden | moe/params.py, experts.shared_experts | num_shared_experts == 0                   |
| moe.bias_update_rate > 0                 | train/step.py (router bias)          | score_func softmax (no bias exists)          |
| model.scan_unroll > 1                    | model/transformer.py scan            | unroll_layers=true (no scan)                 |
| train.profile_steps                      | train/profile.py                     | first step > train.steps                     |
| train.grad_accum_dtype=bfloat16          | train/step.py accumulated            | no micro-batches (the batch runs at once)    |

Accepted, and why (each changes the run, or cannot be decided from the config alone):
- every `choices.py` literal has a reader for each value: Dispatch (moe/dispatchers.DISPATCHERS),
  Transport (moe/transports.TABLE), Overlap (moe/overlap), XlaScheduler
  (launch/xla_flags; latency_hiding off GPU warns at start-up, train/loop.py: the backend is not
  known here and xmoe-plan plans a GPU run on the CPU), Activation, ScoreFunc, DropPolicy (dropless
  too: the queue order sets the row order, so the weight-gradient sums run in another order),
  AuxLossType, DType, ParamDType, StateDType, DataSource (data/sources.py), AttentionImpl
  (model/attention.py; backend-dependent), RematMode (memory, not the losses; every mode is
  distinct), NanPolicy, QKNorm, AttentionType, RopeScalingType, FP8Recipe, FP8Format.
- model.fp8.fast_accum: the GPU kernel's accumulation; off GPU the oracle ignores it (backend).
- model.dense_activation / dense_hidden with num_dense_layers=0: the shipped X-MoE configs name
  the absent dense layer's kind and size to match their gelu experts (sizes, not switches).
- mesh.expert_nodes > 1 without rbd: a different mesh shape; pft exchanges over both axes.
- moe.drop_policy, norm_topk_prob, aux_loss_type with aux_loss_weight=0 (the logged statistic
  changes), mtp_loss_weight with mtp_depth=0, checkpoint.* with checkpoint.enabled=false, and
  data.text_field/split with a source that reads neither: defaults, or values that shared override
  lists set together; refusing them would refuse the defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xmoe_jax.config.checks import _check
from xmoe_jax.config.choices import EXCHANGE_DISPATCH

if TYPE_CHECKING:
    from xmoe_jax.config.run import Config


def exchanges(cfg: Config) -> bool:
    """Routed rows cross devices: pft/rbd inside the block's shard_map over more than one expert device."""
    par = cfg.parallel
    return (
        cfg.model.moe is not None
        and par.dispatch in EXCHANGE_DISPATCH
        and not par.auto_shard
        and cfg.mesh.expert > 1
    )


def _fp8(cfg: Config) -> None:
    fp8, model, par = cfg.model.fp8, cfg.model, cfg.parallel
    if fp8 is None:
        return
    p = "model.fp8."
    if fp8.experts:
        _check(
            model.moe is not None,
            f"{p}experts=true but model.moe is null: there are no routed experts; set {p}experts=false",
        )
        _check(
            par.dispatch in EXCHANGE_DISPATCH,
            f"{p}experts=true: the routed experts run FP8 grouped GEMMs under parallel.dispatch=pft or "
            f"rbd; dispatch={par.dispatch!r} runs them as einsums in the compute dtype, so nothing "
            f"changes. Set parallel.dispatch=pft, or {p}experts=false",
        )
    if fp8.dispatch:
        local = cfg.mesh.expert // cfg.mesh.expert_nodes if par.dispatch == "rbd" else cfg.mesh.expert
        _check(
            exchanges(cfg) and local > 1,
            f"{p}dispatch=true sends pft's routed rows in FP8, but this run exchanges none "
            f"(parallel.dispatch={par.dispatch!r}{', auto_shard' if par.auto_shard else ''}, "
            f"mesh.expert={cfg.mesh.expert}, expert_nodes={cfg.mesh.expert_nodes}): set "
            f"parallel.dispatch=pft with mesh.expert > 1, or {p}dispatch=false",
        )
    if fp8.projections:
        has_shared = model.moe is not None and model.moe.num_shared_experts > 0
        _check(
            model.attention_type == "mha" or model.num_dense_layers > 0 or has_shared,
            f"{p}projections=true covers the MHA q/k/v/o projections and the dense and shared MLPs; "
            "this model has MLA attention, no dense layer and no shared expert, so nothing changes. "
            f"Set {p}projections=false",
        )


def _parallel(cfg: Config) -> None:
    par, moe, p = cfg.parallel, cfg.model.moe, "parallel."
    where = (
        f"(dispatch={par.dispatch!r}{', auto_shard' if par.auto_shard else ''}, "
        f"mesh.expert={cfg.mesh.expert})"
    )
    fix = f"set {p}dispatch=pft or rbd with mesh.expert > 1"
    if not exchanges(cfg):
        _check(
            par.transport == type(par)().transport,  # the default, `auto`
            f"{p}transport={par.transport!r} picks how pft/rbd exchange routed rows, but this run "
            f"exchanges none {where}; {fix}, or {p}transport=auto",
        )
        _check(
            par.recv_buffer_factor is None,
            f"{p}recv_buffer_factor={par.recv_buffer_factor} sizes pft/rbd receive buffers, but this run "
            f"exchanges none {where}; {fix}, or {p}recv_buffer_factor=null",
        )
    ladder = exchanges(cfg) and moe is not None and moe.capacity_factor is None
    if not ladder:
        why = f"exchanges none {where}" if not exchanges(cfg) else "drops tokens (moe.capacity_factor set)"
        _check(
            par.adaptive_buffers,
            f"{p}adaptive_buffers=false turns off the dropless pft/rbd buffer ladder, but this run {why}; "
            f"remove it (true is the default)",
        )
        _check(
            par.buffer_shrink_after == type(par)().buffer_shrink_after,  # the default
            f"{p}buffer_shrink_after={par.buffer_shrink_after} paces the dropless pft/rbd buffer ladder, "
            f"but this run {why}; remove it",
        )
    _check(
        par.overlap_chunks == 1 or (par.dispatch in EXCHANGE_DISPATCH and not par.auto_shard),
        f"{p}overlap_chunks={par.overlap_chunks} splits pft/rbd's block inside the shard_map, but "
        f"dispatch={par.dispatch!r}{' with auto_shard' if par.auto_shard else ''} runs it whole; set "
        f"{p}dispatch=pft or rbd (auto_shard=false), or {p}overlap_chunks=1",
    )
    for name, needs_moe in (("ssmb", True), ("sequence_parallel", False), ("expert_tensor_parallel", True)):
        if not getattr(par, name):
            continue
        _check(
            cfg.mesh.tensor > 1,
            f"{p}{name}=true splits work over the tensor axis, but mesh.tensor=1; set mesh.tensor > 1, "
            f"or {p}{name}=false",
        )
        _check(
            moe is not None or not needs_moe,
            f"{p}{name}=true acts on the MoE block, but model.moe is null; set {p}{name}=false",
        )
    _check(
        not par.route_groups_by_node or par.dispatch == "rbd",
        f"{p}route_groups_by_node=true sizes rbd's cross-node buffers, but dispatch={par.dispatch!r} "
        f"never reads it (routing is moe.num_groups' either way); set {p}dispatch=rbd, or "
        f"{p}route_groups_by_node=false",
    )


def _model(cfg: Config) -> None:
    model, moe = cfg.model, cfg.model.moe
    if moe is not None and moe.num_shared_experts == 0:
        _check(
            not moe.shared_expert_gate,
            "model.moe.shared_expert_gate=true gates the shared experts, but model.moe.num_shared_experts=0; "
            "set model.moe.num_shared_experts >= 1, or model.moe.shared_expert_gate=false",
        )
        _check(
            moe.shared_expert_hidden is None,
            f"model.moe.shared_expert_hidden={moe.shared_expert_hidden} sizes the shared experts, but "
            "model.moe.num_shared_experts=0; set it >= 1, or model.moe.shared_expert_hidden=null",
        )
    if moe is not None:
        _check(
            moe.bias_update_rate == 0 or moe.has_router_bias,
            f"model.moe.bias_update_rate={moe.bias_update_rate} moves the sigmoid router's selection bias, "
            f"but score_func={moe.score_func!r} has none; set model.moe.score_func=sigmoid, or "
            "model.moe.bias_update_rate=0",
        )
    _check(
        model.scan_unroll == 1 or not model.unroll_layers,
        f"model.scan_unroll={model.scan_unroll} unrolls the layer scan, but model.unroll_layers=true "
        "runs no scan; set model.scan_unroll=1, or model.unroll_layers=false",
    )


def _train(cfg: Config) -> None:
    train = cfg.train
    _check(
        train.grad_accum_dtype == "float32"
        or (train.micro_batch_size is not None and train.micro_batch_size < train.batch_size),
        f"train.grad_accum_dtype={train.grad_accum_dtype} sets the dtype of the micro-batches' gradient sum, "
        f"but the batch runs at once (train.micro_batch_size={train.micro_batch_size}, batch_size="
        f"{train.batch_size}); set train.micro_batch_size to a divisor of the batch, or grad_accum_dtype=float32",
    )
    profile = train.profile_steps
    _check(
        profile is None or profile[0] <= train.steps,
        f"train.profile_steps={list(profile or ())} starts after the last step (train.steps="
        f"{train.steps}), so nothing is traced; set train.profile_steps=[1, {min(3, train.steps)}] "
        "or null",
    )


def check_switches(cfg: Config) -> None:
    """Every switch of `cfg` applies to the run it describes (the table of the module docstring)."""
    _fp8(cfg)
    _parallel(cfg)
    _model(cfg)
    _train(cfg)


def check_mesh_switches(cfg: Config, data_devices: int) -> None:
    """The switches that need the resolved mesh: FSDP over a data axis of one device shards nothing."""
    _check(
        not cfg.mesh.fsdp or data_devices > 1,
        f"mesh.fsdp=true shards parameters over the data axis, but it resolves to {data_devices} device "
        "here; set mesh.fsdp=false (or a data axis > 1)",
    )
