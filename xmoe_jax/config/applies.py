"""Switches that cannot apply: a value the run would accept but never read, so it trains exactly as
without it, is refused, naming the reason and the fix (issue 31).

The table is data: `REFUSALS` below, one `Refusal` per row, each holding the check that refuses it
and an example the check must refuse (tests/test_switches.py runs every row's example through its
own check and through loading; a row cannot be written without a check); `table()` renders it as
markdown. Each row was checked against the code that reads the field. A row's `when` says where its
check runs:
  load     `check_switches`, from `loading.from_dict`: every config as written (YAML, `--set`, a
           run's config.yaml), not the facts `resolve.py` fills in later;
  devices  `run.check_mesh_switches`, from `Config.validate_for_devices` (the resolved mesh);
  train    `check_training_data`, from the trainer before it opens its data (train/loop.py): a
           run's config.yaml may pair a tokenizer with no data for the tools (an imported
           model's, for xmoe-generate), but training on synthetic numbers reads none.
`parallel.overlap` with a dispatch other than pft/rbd is refused by `ParallelConfig` itself.

Accepted, and why (each changes the run, or cannot be decided from the config alone):
- every `choices.py` literal has a reader for each value: Dispatch (moe/dispatchers.DISPATCHERS;
  `auto` is settled by `Config`: config/parallel.py), Transport (moe/transports.TABLE), Overlap (moe/overlap), XlaScheduler
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
- parallel.dispatch=dense on a model without routed experts: the default that runs before `auto`
  wrote into every config.yaml; data.tokenizer=bytes with synthetic data: what the trainer records
  for synthetic data (data/provenance.py), so a resumed run's config.yaml holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from xmoe_jax.config.checks import _check
from xmoe_jax.config.choices import EXCHANGE_DISPATCH
from xmoe_jax.config.run import Config, check_mesh_switches


@dataclass(frozen=True)
class Refusal:
    """One row of the table: `switches` (dotted keys), the code that reads them, when they cannot
    apply, the check that refuses them (a `ConfigError` naming one of `switches`, the reason and the
    fix), where it runs (`when`: the module docstring), and `example`, `--set` overrides on
    configs/tiny.yaml that it refuses."""

    switches: tuple[str, ...]
    read_by: str
    refused_when: str
    check: Callable[..., None]
    example: tuple[str, ...]
    when: Literal["load", "devices", "train"] = "load"


def exchanges(cfg: Config) -> bool:
    """Routed rows cross devices: pft/rbd inside the block's shard_map over more than one expert device."""
    par = cfg.parallel
    return (
        cfg.model.moe is not None
        and par.dispatch in EXCHANGE_DISPATCH
        and not par.auto_shard
        and cfg.mesh.expert > 1
    )


def _no_exchange(cfg: Config) -> tuple[str, str]:
    """Why this run exchanges no routed rows, and the fix, for the exchange switches' messages."""
    par = cfg.parallel
    if cfg.model.moe is None:
        return "(model.moe is null: no routed experts)", "remove it"
    where = f"(dispatch={par.dispatch!r}{', auto_shard' if par.auto_shard else ''}, mesh.expert={cfg.mesh.expert})"
    return where, "set parallel.dispatch=pft or rbd with mesh.expert > 1"


def _no_experts(cfg: Config) -> None:
    """A model without routed experts has no MoE block to place."""
    par, p = cfg.parallel, "parallel."
    if cfg.model.moe is not None:
        return
    why = "but model.moe is null: this model has no routed experts"
    _check(
        par.dispatch in ("auto", "dense"),
        f"{p}dispatch={par.dispatch!r} places routed experts, {why}; remove it (auto, the default, "
        "fits any model)",
    )
    _check(
        par.overlap == "none",
        f"{p}overlap={par.overlap!r} orders the MoE block's exchange, {why}; set {p}overlap=none",
    )
    _check(
        par.overlap_chunks == 1,
        f"{p}overlap_chunks={par.overlap_chunks} splits the MoE block's tokens, {why}; set {p}overlap_chunks=1",
    )


def _fp8_experts(cfg: Config) -> None:
    fp8, p = cfg.model.fp8, "model.fp8."
    if fp8 is None or not fp8.experts:
        return
    _check(
        cfg.model.moe is not None,
        f"{p}experts=true but model.moe is null: there are no routed experts; set {p}experts=false",
    )
    dispatch = cfg.parallel.dispatch
    _check(
        dispatch in EXCHANGE_DISPATCH,
        f"{p}experts=true: the routed experts run FP8 grouped GEMMs under parallel.dispatch=pft or "
        f"rbd; dispatch={dispatch!r} runs them as einsums in the compute dtype, so nothing "
        f"changes. Set parallel.dispatch=pft, or {p}experts=false",
    )


def _fp8_dispatch(cfg: Config) -> None:
    fp8, par, p = cfg.model.fp8, cfg.parallel, "model.fp8."
    if fp8 is None or not fp8.dispatch:
        return
    local = cfg.mesh.expert // cfg.mesh.expert_nodes if par.dispatch == "rbd" else cfg.mesh.expert
    _check(
        exchanges(cfg) and local > 1,
        f"{p}dispatch=true sends pft's routed rows in FP8, but this run exchanges none "
        f"(parallel.dispatch={par.dispatch!r}{', auto_shard' if par.auto_shard else ''}, "
        f"mesh.expert={cfg.mesh.expert}, expert_nodes={cfg.mesh.expert_nodes}): set "
        f"parallel.dispatch=pft with mesh.expert > 1, or {p}dispatch=false",
    )


def _fp8_projections(cfg: Config) -> None:
    fp8, model, p = cfg.model.fp8, cfg.model, "model.fp8."
    if fp8 is None or not fp8.projections:
        return
    has_shared = model.moe is not None and model.moe.num_shared_experts > 0
    _check(
        model.attention_type == "mha" or model.num_dense_layers > 0 or has_shared,
        f"{p}projections=true covers the MHA q/k/v/o projections and the dense and shared MLPs; "
        "this model has MLA attention, no dense layer and no shared expert, so nothing changes. "
        f"Set {p}projections=false",
    )


def _transport(cfg: Config) -> None:
    par, p = cfg.parallel, "parallel."
    if exchanges(cfg):
        return
    where, fix = _no_exchange(cfg)
    _check(
        par.transport == type(par)().transport,  # the default, `auto`
        f"{p}transport={par.transport!r} picks how pft/rbd exchange routed rows, but this run "
        f"exchanges none {where}; {fix}, or {p}transport=auto",
    )


def _recv_buffer_factor(cfg: Config) -> None:
    par, p = cfg.parallel, "parallel."
    if exchanges(cfg):
        return
    where, fix = _no_exchange(cfg)
    _check(
        par.recv_buffer_factor is None,
        f"{p}recv_buffer_factor={par.recv_buffer_factor} sizes pft/rbd receive buffers, but this run "
        f"exchanges none {where}; {fix}, or {p}recv_buffer_factor=null",
    )


def _buffer_ladder(cfg: Config) -> None:
    par, moe, p = cfg.parallel, cfg.model.moe, "parallel."
    if exchanges(cfg) and moe is not None and moe.capacity_factor is None:
        return
    why = (
        f"exchanges none {_no_exchange(cfg)[0]}"
        if not exchanges(cfg)
        else "drops tokens (moe.capacity_factor set)"
    )
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


def _overlap_chunks(cfg: Config) -> None:
    par, p = cfg.parallel, "parallel."
    _check(
        par.overlap_chunks == 1 or (par.dispatch in EXCHANGE_DISPATCH and not par.auto_shard),
        f"{p}overlap_chunks={par.overlap_chunks} splits pft/rbd's block inside the shard_map, but "
        f"dispatch={par.dispatch!r}{' with auto_shard' if par.auto_shard else ''} runs it whole; set "
        f"{p}dispatch=pft or rbd (auto_shard=false), or {p}overlap_chunks=1",
    )


def _tensor_axis(cfg: Config) -> None:
    par, p = cfg.parallel, "parallel."
    for name, needs_moe in (("ssmb", True), ("sequence_parallel", False), ("expert_tensor_parallel", True)):
        if not getattr(par, name):
            continue
        _check(
            cfg.mesh.tensor > 1,
            f"{p}{name}=true splits work over the tensor axis, but mesh.tensor=1; set mesh.tensor > 1, "
            f"or {p}{name}=false",
        )
        _check(
            cfg.model.moe is not None or not needs_moe,
            f"{p}{name}=true acts on the MoE block, but model.moe is null; set {p}{name}=false",
        )


def _route_groups_by_node(cfg: Config) -> None:
    par, p = cfg.parallel, "parallel."
    _check(
        not par.route_groups_by_node or par.dispatch == "rbd",
        f"{p}route_groups_by_node=true sizes rbd's cross-node buffers, but dispatch={par.dispatch!r} "
        f"never reads it (routing is moe.num_groups' either way); set {p}dispatch=rbd, or "
        f"{p}route_groups_by_node=false",
    )


def _shared_experts(cfg: Config) -> None:
    moe = cfg.model.moe
    if moe is None or moe.num_shared_experts > 0:
        return
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


def _bias_update_rate(cfg: Config) -> None:
    moe = cfg.model.moe
    if moe is None:
        return
    _check(
        moe.bias_update_rate == 0 or moe.has_router_bias,
        f"model.moe.bias_update_rate={moe.bias_update_rate} moves the sigmoid router's selection bias, "
        f"but score_func={moe.score_func!r} has none; set model.moe.score_func=sigmoid, or "
        "model.moe.bias_update_rate=0",
    )


def _scan_unroll(cfg: Config) -> None:
    model = cfg.model
    _check(
        model.scan_unroll == 1 or not model.unroll_layers,
        f"model.scan_unroll={model.scan_unroll} unrolls the layer scan, but model.unroll_layers=true "
        "runs no scan; set model.scan_unroll=1, or model.unroll_layers=false",
    )


def _profile_steps(cfg: Config) -> None:
    train, profile = cfg.train, cfg.train.profile_steps
    _check(
        profile is None or profile[0] <= train.steps,
        f"train.profile_steps={list(profile or ())} starts after the last step (train.steps="
        f"{train.steps}), so nothing is traced; set train.profile_steps=[1, {min(3, train.steps)}] "
        "or null",
    )


def _grad_accum_dtype(cfg: Config) -> None:
    train = cfg.train
    _check(
        train.grad_accum_dtype == "float32"
        or (train.micro_batch_size is not None and train.micro_batch_size < train.batch_size),
        f"train.grad_accum_dtype={train.grad_accum_dtype} sets the dtype of the micro-batches' gradient sum, "
        f"but the batch runs at once (train.micro_batch_size={train.micro_batch_size}, batch_size="
        f"{train.batch_size}); set train.micro_batch_size to a divisor of the batch, or grad_accum_dtype=float32",
    )


def check_training_data(cfg: Config) -> None:
    """The trainer's row (`when="train"`): a tokenizer file tokenizes nothing when every training
    source is synthetic numbers."""
    data = cfg.data
    synthetic = all(s.source == "synthetic" or (s.source == "auto" and s.path is None) for s in data.sources)
    _check(
        data.tokenizer in ("auto", "bytes") or not synthetic,
        f"data.tokenizer={data.tokenizer!r} tokenizes text, but the training data is synthetic numbers "
        '(no data.path), so nothing is tokenized; set data.path to your data (README "Your data"), or '
        "data.tokenizer=auto",
    )


REFUSALS: tuple[Refusal, ...] = (
    Refusal(("parallel.dispatch", "parallel.overlap", "parallel.overlap_chunks"), "moe/ (the MoE block)",
            "model.moe is null (dispatch other than auto/dense, overlap, chunks)", _no_experts,
            ("model.moe=null", "model.num_dense_layers=3", "parallel.dispatch=pft")),
    Refusal(("model.fp8.experts",), "moe/experts.py grouped/combined GEMMs",
            "dispatch dense/padded (einsum experts), no MoE", _fp8_experts,
            ("parallel.dispatch=dense", "model.fp8={projections: false}")),
    Refusal(("model.fp8.dispatch",), "moe/pft.py exchange",
            "no exchange: not pft/rbd, auto_shard, 1 expert device (rbd: 1 per node)", _fp8_dispatch,
            ("model.fp8={projections: false, experts: false, dispatch: true}",)),
    Refusal(("model.fp8.projections",), "model/layers.py, moe/experts.dense_mlp",
            "MLA with no dense layer and no shared expert", _fp8_projections,
            ("model.attention_type=mla", "model.mla={}", "model.num_kv_heads=null", "model.num_dense_layers=0", "model.moe.num_shared_experts=0",
             "model.fp8={experts: false}")),
    Refusal(("parallel.transport",), "moe/exchange.py, moe/layouts.py", "no exchange (not auto)", _transport,
            ("parallel.transport=ragged",)),
    Refusal(("parallel.recv_buffer_factor",), "moe/pft.py recv_rows, train/buffers", "no exchange (set)",
            _recv_buffer_factor, ("parallel.recv_buffer_factor=1.5",)),
    Refusal(("parallel.adaptive_buffers", "parallel.buffer_shrink_after"), "moe/ladder.applies",
            "no exchange, or capacity_factor set (drops)", _buffer_ladder, ("parallel.adaptive_buffers=false",)),
    Refusal(("parallel.overlap_chunks",), "moe/dispatchers._in_chunks",
            "> 1, not pft/rbd inside shard_map (auto_shard)", _overlap_chunks,
            ("parallel.dispatch=dense", "parallel.overlap_chunks=2")),
    Refusal(("parallel.ssmb", "parallel.sequence_parallel", "parallel.expert_tensor_parallel"), "sharding rules",
            "mesh.tensor == 1; ssmb/etp without MoE", _tensor_axis, ("parallel.ssmb=true",)),
    Refusal(("parallel.route_groups_by_node",), "moe/rbd.py (pilot sizing)", "dispatch is not rbd",
            _route_groups_by_node,
            ("parallel.dispatch=pft", "mesh.expert=4", "model.moe.score_func=sigmoid", "model.moe.num_groups=1",
             "parallel.route_groups_by_node=true")),
    Refusal(("model.moe.shared_expert_gate", "model.moe.shared_expert_hidden"),
            "moe/params.py, experts.shared_experts", "num_shared_experts == 0", _shared_experts,
            ("model.moe.num_shared_experts=0", "model.moe.shared_expert_gate=true")),
    Refusal(("model.moe.bias_update_rate",), "train/step.py (router bias)",
            "> 0 with score_func softmax (no bias exists)", _bias_update_rate, ("model.moe.bias_update_rate=0.01",)),
    Refusal(("model.scan_unroll",), "model/transformer.py scan", "> 1 with unroll_layers=true (no scan)",
            _scan_unroll, ("model.unroll_layers=true", "model.scan_unroll=2")),
    Refusal(("train.profile_steps",), "train/profile.py", "first step > train.steps", _profile_steps,
            ("train.steps=5", "train.profile_steps=[6, 8]")),
    Refusal(("train.grad_accum_dtype",), "train/step.py accumulated",
            "bfloat16 with no micro-batches (the batch runs at once)", _grad_accum_dtype,
            ("train.grad_accum_dtype=bfloat16",)),
    Refusal(("mesh.fsdp",), "sharding.param_rules", "the data axis resolves to 1 device", check_mesh_switches,
            ("mesh.fsdp=true",), when="devices"),
    Refusal(("data.tokenizer",), "data/provenance.py (the run's copy)",
            "a tokenizer (not auto/bytes) and every training source synthetic", check_training_data,
            ("data.tokenizer=tokenizer.json",), when="train"),
)  # fmt: skip


def check_switches(cfg: Config) -> None:
    """Every switch of `cfg` applies to the run it describes: the checks of the table's `load` rows."""
    for row in REFUSALS:
        if row.when == "load":
            row.check(cfg)


def table() -> str:
    """`REFUSALS` as a markdown table."""
    rows = [("switch", "read by", "cannot apply when (refused)", "checked at")]
    rows += [(", ".join(r.switches), r.read_by, r.refused_when, r.when) for r in REFUSALS]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
