"""Multi-token prediction (DeepSeek-V3 §2.2): `model.mtp_depth` extra modules; module k predicts
the token k + 1 positions ahead, sequentially after module k - 1, for a denser training signal.

Shapes: B batch, S sequence, D model, V vocab; k is the depth of a module (1 .. mtp_depth).

Module k at position i (DeepSeek-V3 eqs. 21-25; the projection's input order, and which
representation each module reads, are those of the released checkpoint as transformers' MtpModel
and vLLM run it):
  1. z_i = enorm(Emb(t_{i+k})) @ eh_proj[0] + hnorm(h^{k-1}_i) @ eh_proj[1] ([2,D,D], i.e. the
     concatenation times one [2D,D] matrix), with Emb the main model's embedding, h^0 the main
     model's final-normed output and h^{k-1} module k-1's normed output (step 3);
  2. one transformer block on z (block.py; MoE when the main model has MoE layers), run under the
     `model.remat` policy like the main blocks; h^k = out_norm(its output);
  3. logits = h^k @ the main model's head; cross-entropy against t_{i+k+1} over the S - k
     positions that have one (chunked, model/loss.py);
  L_MTP = mtp_loss_weight / mtp_depth * sum_k L_k, added to the training loss (train/step.py).
With inputs t_0..t_{S-1} and targets t_1..t_S, module k reads targets[i+k-1] and predicts
targets[i+k]; positions past the end read token 0 and count for nothing (they come last, so
causal attention keeps them from every counted position). Evaluation, generation and the
converters' logits use the main model only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xmoe_jax.config import ModelConfig, ParallelConfig
from xmoe_jax.model.block import RESIDUAL, Block, constrainer
from xmoe_jax.model.layers import RMSNorm, dtypes, param
from xmoe_jax.model.loss import chunked_cross_entropy
from xmoe_jax.moe.stats import MoEStats
from xmoe_jax.remat import remat


class MTPModule(nnx.Module):
    """Steps 1-2 of one depth, and the norm of step 3."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, parallel: ParallelConfig):
        _, pdt = dtypes(cfg)
        self.enorm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.hnorm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.eh_proj = param(rngs, (2, cfg.hidden, cfg.hidden), (None, "embed", None), cfg.init_std, pdt)
        self.block = Block(cfg, cfg.num_moe_layers > 0, rngs, parallel)
        self.out_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.parallel = parallel

    def __call__(self, h_BSD: jax.Array, e_BSD: jax.Array) -> tuple[jax.Array, MoEStats | None]:
        """(h^k, the block's MoE statistics) from h^{k-1} and the shifted embeddings."""
        w_2DD = self.eh_proj[...].astype(h_BSD.dtype)
        z_BSD = self.enorm(e_BSD) @ w_2DD[0] + self.hnorm(h_BSD) @ w_2DD[1]
        y_BSD, stats = self.block(constrainer(self.parallel)(z_BSD, RESIDUAL))
        return self.out_norm(y_BSD), stats


def _shifted(a_BS: jax.Array, by: int) -> jax.Array:
    """a[:, i + by], zero past the end."""
    if by == 0:
        return a_BS
    return jnp.concatenate([a_BS[:, by:], jnp.zeros((a_BS.shape[0], by), a_BS.dtype)], axis=1)


def mtp_loss(model, h_BSD: jax.Array, targets_BS: jax.Array) -> tuple[jax.Array, MoEStats | None]:
    """L_MTP / mtp_loss_weight (the mean over depths of L_k) and the modules' MoE statistics
    ([depth] leaves); `model` is the Transformer, `h_BSD` its final-normed output."""
    cfg = model.cfg
    dt, _ = dtypes(cfg)
    graphdef, state = nnx.split(model.mtp_layers)

    def depth(h_BSD, layer_state, e_BSD):
        return nnx.merge(graphdef, layer_state)(h_BSD, e_BSD)

    depth = remat(depth, cfg.remat)
    seq = targets_BS.shape[1]
    head_DV, constrain = model.head(), constrainer(model.parallel)
    losses, stats = [], []
    for k in range(1, cfg.mtp_depth + 1):
        e_BSD = jnp.take(model.embed[...], _shifted(targets_BS, k - 1), axis=0).astype(dt)
        layer_state = jax.tree.map(lambda a, k=k: a[k - 1], state)
        h_BSD, st = depth(h_BSD, layer_state, constrain(e_BSD, RESIDUAL))
        weights_BS = jnp.broadcast_to(jnp.arange(seq) < seq - k, targets_BS.shape)
        loss = chunked_cross_entropy(
            h_BSD, head_DV, _shifted(targets_BS, k), cfg.loss_chunk, constrain, weights_BS
        )
        losses.append(loss)
        stats.append(st)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats[0] is not None else None
    return sum(losses) / cfg.mtp_depth, stacked
