"""Activation checkpointing: what a transformer block keeps for its backward pass.

The block's code tags the tensors worth keeping with `jax.ad_checkpoint.checkpoint_name`
(tags are no-ops without a policy); a policy below keeps some tags and recomputes the
rest in the backward pass. The block input is always kept (it is the scan carry).

| model.remat                 | keeps                                                   | recomputes                                   |
|-----------------------------|---------------------------------------------------------|----------------------------------------------|
| none                        | everything autodiff keeps                               | nothing                                      |
| full                        | the block input only                                    | the whole block, exchange included           |
| save_dots                   | every matmul output (q/k/v/o projections, MLA's latents and their expansion, attention core, dense MLP and expert GEMMs) and the dispatched rows | norms, activations, rope, routing, permutes (Megatron's "selective": the cheap work) |
| save_attention_and_experts  | the attention core output, the expert GEMM outputs and the dispatched rows | norms, projections, activations, routing, permutes |
| save_sublayer_outputs       | the attention and MLP/MoE branch outputs                | everything inside them (the MoE exchange runs again) |

Model FLOPs for MFU never count the recomputation (train/metrics.py).
"""

from __future__ import annotations

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

_save = jax.checkpoint_policies.save_only_these_names
POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": _save(
        ATTN_QKV, ATTN_CORE, ATTN_OUT, MLP_HIDDEN, MLP_OUT, MOE_DISPATCHED, EXPERT_HIDDEN, EXPERT_OUT
    ),
    "save_attention_and_experts": _save(ATTN_CORE, MOE_DISPATCHED, EXPERT_HIDDEN, EXPERT_OUT),
    "save_sublayer_outputs": _save(ATTN_OUT, MLP_OUT, MOE_OUT),
}
REMAT_MODES = ("none", *POLICIES)


def tag(x, name: str):
    """Mark `x` as the tensor `name` for the remat policies."""
    return checkpoint_name(x, name)


def remat(fn, mode: str):
    """`fn` under the policy `mode` (unchanged for "none")."""
    if mode == "none":
        return fn
    if mode not in POLICIES:
        raise ValueError(f"model.remat={mode!r} is not one of {list(REMAT_MODES)}")
    return jax.checkpoint(fn, policy=POLICIES[mode], prevent_cse=False)
