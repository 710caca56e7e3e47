"""The closed sets of values config fields take (`Literal` types): the dataclasses annotate their
fields with these, and `checks._check_choices` / `loading._coerce` refuse anything else."""

from __future__ import annotations

import typing
from typing import Literal

Dispatch = Literal["auto", "dense", "padded", "pft", "rbd"]
Transport = Literal["auto", "bucketed", "exact", "ragged", "emulated", "push"]
Overlap = Literal["none", "shared", "chunks", "both"]
XlaScheduler = Literal["default", "latency_hiding"]
Activation = Literal["swiglu", "gelu"]
ScoreFunc = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]
AuxLossType = Literal["micro_batch", "sequence", "none"]
DType = Literal["bfloat16", "float32", "float16"]
ParamDType = Literal["float32", "bfloat16"]
StateDType = Literal["float32", "bfloat16"]
AccumDType = Literal["float32", "bfloat16"]
DataSource = Literal["auto", "synthetic", "text", "files", "hf", "arrayrecord", "megatron"]
AttentionImpl = Literal["auto", "cudnn", "pallas", "xla"]
RematMode = Literal[
    "none",
    "full",
    "save_dots",
    "save_attention_and_experts",
    "save_sublayer_outputs",
    "save_exchange",
]
NanPolicy = Literal["stop", "skip"]
QKNorm = Literal["none", "head", "full"]
AttentionType = Literal["mha", "mla"]
RopeScalingType = Literal["yarn"]
FP8Recipe = Literal["tensorwise", "rowwise", "blockwise"]
FP8Format = Literal["e4m3", "e5m2"]

# values a field took once: why each went and what to use instead (`{field}` is the dotted field).
# Loading (`loading._coerce`, the CLI's path) and the dataclasses (`checks._check_choices`) both
# refuse them with this reason, never with the bare list of choices.
REMOVED: dict[object, dict[str, str]] = {
    RematMode: {
        "offload_experts": (
            "{field}=offload_experts was removed: on an H100 it trained a different model (loss 9.442 "
            "against 9.160 for none, full and save_dots after 15 steps; benchmarks/memory.md) while costing "
            "more time than full recomputation; use {field}=save_exchange (what it kept on the device) or full"
        ),
    },
}


def removed(tp: object, value: object, field: str) -> str | None:
    """The reason a removed `value` of the Literal `tp` is refused, naming `field`; None otherwise."""
    reason = REMOVED.get(tp, {}).get(value) if isinstance(value, str) else None
    return reason.format(field=field) if reason else None


DISPATCH_MODES = typing.get_args(Dispatch)  # `auto` included: a Config settles it (config/parallel.py)
TRANSPORTS = typing.get_args(Transport)
# the dispatch modes whose routed rows cross devices (moe/dispatchers.py's `exchanges_tokens`; config
# imports no JAX, so the names are here and tests/test_resolve.py checks them against the table)
EXCHANGE_DISPATCH = ("pft", "rbd")
