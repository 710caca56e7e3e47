"""Activation checkpointing: what a transformer block keeps for its backward pass.

The block's code tags the tensors worth keeping with `jax.ad_checkpoint.checkpoint_name`
(tags are no-ops without a policy); a policy below keeps some tags and recomputes the
rest in the backward pass. The block input is always kept (it is the scan carry).

| model.remat                 | keeps                                                   | recomputes                                   |
|-----------------------------|---------------------------------------------------------|----------------------------------------------|
| none                        | everything autodiff keeps                               | nothing                                      |
| full                        | the block input only (and, as every policy, the router's top-k choice) | the whole block, exchange included           |
| save_dots                   | every matmul output (q/k/v/o projections, MLA's latents and their expansion, attention core, dense MLP and expert GEMMs) and what the exchanges delivered | norms, activations, rope, routing, permutes (Megatron's "selective": the cheap work) |
| save_attention_and_experts  | the attention core output, the expert GEMM outputs and what the exchanges delivered | norms, projections, activations, routing, permutes |
| save_sublayer_outputs       | the attention and MLP/MoE branch outputs                | everything inside them (the MoE exchange runs again) |
| save_exchange               | what each all-to-all delivered (dispatched rows and their routing weights; the returned rows are not needed: the weights were folded in before them) | everything else: the exchanges never run a third time |

Model FLOPs for MFU never count the recomputation (train/metrics.py). `offload_experts` (the expert
GEMMs' hidden and outputs in pinned host memory) was removed: on an H100 it trained a different model
than `none` (benchmarks/memory.md), and a config naming it is refused with that reason.
"""

from __future__ import annotations

import contextvars
import functools

import jax
from jax.ad_checkpoint import checkpoint_name

# tags placed by the block's code
ATTN_QKV, ATTN_CORE, ATTN_OUT = "attn_qkv", "attn_core", "attn_out"
MLP_HIDDEN, MLP_OUT = "mlp_hidden", "mlp_out"
MOE_DISPATCHED, EXPERT_HIDDEN, EXPERT_OUT, MOE_OUT = (
    "moe_dispatched",
    "expert_hidden",
    "expert_out",
    "moe_out",
)
# what an exchange (all-to-all) delivers: the dispatched rows on the expert side, the expert
# outputs back on the token side (pft; rbd's stages and its combine), and what rides with them
EXCHANGE_IN, EXCHANGE_OUT = "exchange_in", "exchange_out"
# the router's top-k choice (int32 [T, K]): every policy keeps it, so the backward pass never
# re-decides a near-tie differently from the forward (a recomputed router in bf16 can: measured
# on an H100, a policy that recomputed the routing but kept the expert hidden drifted from `none`)
ROUTING = "routing"

_save = jax.checkpoint_policies.save_only_these_names
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("xmoe_remat_mode", default="none")
_KEEPS = {
    "full": (ROUTING,),
    "save_dots": (ATTN_QKV, ATTN_CORE, ATTN_OUT, MLP_HIDDEN, MLP_OUT, MOE_DISPATCHED, EXCHANGE_IN, EXCHANGE_OUT,
                  EXPERT_HIDDEN, EXPERT_OUT, ROUTING),
    "save_attention_and_experts": (ATTN_CORE, MOE_DISPATCHED, EXCHANGE_IN, EXCHANGE_OUT, EXPERT_HIDDEN, EXPERT_OUT,
                                   ROUTING),
    "save_sublayer_outputs": (ATTN_OUT, MLP_OUT, MOE_OUT, ROUTING),
    "save_exchange": (EXCHANGE_IN, EXCHANGE_OUT, ROUTING),
}  # fmt: skip
POLICIES = {mode: _save(*names) for mode, names in _KEEPS.items()}
REMAT_MODES = ("none", *POLICIES)


def tag(x, name: str):
    """Mark `x` as the tensor `name` for the remat policies."""
    return checkpoint_name(x, name)


def remat(fn, mode: str, straight_line: bool = False):
    """`fn` under the policy `mode` (unchanged for "none").

    `straight_line`: the forward and backward layers end up in one straight-line program (layers
    unrolled, or a scan whose one iteration holds every layer, which XLA inlines). XLA's common
    subexpression elimination would then merge each recomputation with the forward value it
    repeats and keep that value alive until the backward pass, undoing the policy (measured: the
    `save_dots` step held exactly what `none` holds). The recomputation is fenced off then; inside
    a looping scan the loop boundary already keeps them apart, and the fence would only cost
    speed.
    """
    if mode == "none":
        return fn
    if mode not in POLICIES:
        raise ValueError(f"model.remat={mode!r} is not one of {list(REMAT_MODES)}")

    @functools.wraps(fn)
    def traced_under_mode(*args, **kwargs):
        token = _MODE.set(mode)  # what `keeps` answers while fn is traced
        try:
            return fn(*args, **kwargs)
        finally:
            _MODE.reset(token)

    return jax.checkpoint(traced_under_mode, policy=POLICIES[mode], prevent_cse=straight_line)


def keeps(name: str) -> bool:
    """Whether the block being traced keeps tag `name` for its backward pass (true outside `remat`
    and under model.remat=none: autodiff keeps everything). Code whose recomputation would cost more
    than the tensor (an op that also runs an exchange) asks before producing it that way."""
    mode = _MODE.get()
    return mode == "none" or name in _KEEPS[mode]
