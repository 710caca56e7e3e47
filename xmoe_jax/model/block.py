"""One pre-norm residual transformer block: attention (MHA/GQA or MLA), then a dense MLP or an
MoE block, each added to the residual stream.

Shapes: B batch, S sequence, T new tokens (generation), D model.

The residual stream is laid out ("batch", "residual_seq", "embed") (transformer.py says why);
`constrainer` maps logical names to the ambient mesh under the placement's activation rules.
The attention is `layers.Attention` or, with `model.attention_type: mla`, `mla.MLAttention`:
both take (x, constrain) and decode against a KV cache.
"""

from __future__ import annotations

import jax
from flax import nnx

from xmoe_jax import sharding
from xmoe_jax.config import ModelConfig, ParallelConfig
from xmoe_jax.model.layers import MLP, Attention, RMSNorm, dtypes
from xmoe_jax.model.mla import MLAttention
from xmoe_jax.model.moe_block import MoEBlock
from xmoe_jax.moe.stats import MoEStats
from xmoe_jax.remat import ATTN_OUT, MOE_OUT, tag

RESIDUAL = ("batch", "residual_seq", "embed")
ATTENTION = {"mha": Attention, "mla": MLAttention}


def constrainer(parallel: ParallelConfig):
    rules = sharding.activation_rules(sequence_parallel=parallel.sequence_parallel)
    return sharding.constrainer(sharding.current_mesh(), rules)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, is_moe: bool, rngs: nnx.Rngs, parallel: ParallelConfig):
        _, pdt = dtypes(cfg)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.attn = ATTENTION[cfg.attention_type](cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.is_moe = is_moe
        self.parallel = parallel
        if is_moe:
            self.moe = MoEBlock(cfg, rngs, parallel)
        else:
            self.mlp = MLP(cfg.hidden, cfg.dense_hidden, cfg.dense_activation, cfg, rngs)

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, MoEStats | None]:
        constrain = constrainer(self.parallel)
        return self._feed_forward(x_BSD, self.attn(self.attn_norm(x_BSD), constrain), constrain)

    def decode(self, x_BTD: jax.Array, cache) -> tuple[jax.Array, object]:
        """The block on T new tokens per row against its KV cache (generation); (x, new cache)."""
        constrain = constrainer(self.parallel)
        attn_BTD, cache = self.attn.decode(self.attn_norm(x_BTD), cache, constrain)
        x_BTD, _ = self._feed_forward(x_BTD, attn_BTD, constrain)
        return x_BTD, cache

    def _feed_forward(self, x_BSD, attn_BSD, constrain) -> tuple[jax.Array, MoEStats | None]:
        """Adds the attention output to the residual, then the MLP or MoE sub-layer."""
        attn_BSD = tag(constrain(attn_BSD, RESIDUAL), ATTN_OUT)
        x_BSD = x_BSD + attn_BSD
        h_BSD = self.mlp_norm(x_BSD)
        if self.is_moe:
            y_BSD, stats = self.moe(h_BSD)
            y_BSD = tag(y_BSD, MOE_OUT)
        else:
            y_BSD, stats = self.mlp(h_BSD, constrain), None
        x_BSD = constrain(x_BSD + y_BSD, RESIDUAL)
        return x_BSD, stats
