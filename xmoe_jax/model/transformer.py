"""Decoder-only MoE transformer: embeddings, first-k dense layers, MoE layers, LM head.

Shapes: B batch, S sequence, D model, V vocab. Pre-norm residual blocks; untied
embedding and output head; bf16 compute (model.dtype) over float32 master weights.

The residual stream is laid out ("batch", "residual_seq", "embed"): batch over the
token axes and, with `parallel.sequence_parallel`, the sequence split over the tensor
axis, so norms and residual adds run on 1/TP of the tokens and attention / MLPs
gather the sequence and reduce-scatter their row-parallel outputs back. An SSMB MoE
block takes that layout as is (its tokens are split the same way). The mesh is the
ambient one (`jax.set_mesh`; none = one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xmoe_jax import sharding
from xmoe_jax.config import ModelConfig, ParallelConfig
from xmoe_jax.model.layers import MLP, Attention, RMSNorm, dtypes, param
from xmoe_jax.model.moe_block import MoEBlock
from xmoe_jax.moe.stats import MoEStats

RESIDUAL = ("batch", "residual_seq", "embed")


def _constrainer(parallel: ParallelConfig):
    rules = sharding.activation_rules(sequence_parallel=parallel.sequence_parallel)
    return sharding.constrainer(sharding.current_mesh(), rules)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, is_moe: bool, rngs: nnx.Rngs, parallel: ParallelConfig):
        _, pdt = dtypes(cfg)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.is_moe = is_moe
        self.parallel = parallel
        if is_moe:
            self.moe = MoEBlock(cfg, rngs, parallel)
        else:
            self.mlp = MLP(cfg.hidden, cfg.dense_hidden, cfg.dense_activation, cfg, rngs)

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, MoEStats | None]:
        constrain = _constrainer(self.parallel)
        x_BSD = x_BSD + constrain(self.attn(self.attn_norm(x_BSD), constrain), RESIDUAL)
        h_BSD = self.mlp_norm(x_BSD)
        if self.is_moe:
            y_BSD, stats = self.moe(h_BSD)
        else:
            y_BSD, stats = self.mlp(h_BSD, constrain), None
        x_BSD = constrain(x_BSD + y_BSD, RESIDUAL)
        return x_BSD, stats


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, parallel: ParallelConfig | None = None):
        _, pdt = dtypes(cfg)
        parallel = parallel or ParallelConfig()
        self.cfg = cfg
        self.parallel = parallel
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden), ("vocab", "embed"), 1.0, pdt)
        self.layers = nnx.Dict(
            {
                f"layer_{i:03d}": Block(cfg, i >= cfg.num_dense_layers, rngs, parallel)
                for i in range(cfg.num_layers)
            }
        )
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.lm_head = param(rngs, (cfg.hidden, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pdt)

    def __call__(self, tokens_BS: jax.Array) -> tuple[jax.Array, dict[str, MoEStats]]:
        """Float32 logits [B,S,V] and each MoE layer's statistics keyed by its module path."""
        dt, _ = dtypes(self.cfg)
        constrain = _constrainer(self.parallel)
        x_BSD = constrain(jnp.take(self.embed[...], tokens_BS, axis=0).astype(dt), RESIDUAL)
        stats = {}
        for name in sorted(self.layers.keys()):
            x_BSD, layer_stats = self.layers[name](x_BSD)
            if layer_stats is not None:
                stats[f"layers/{name}/moe"] = layer_stats
        x_BSD = self.final_norm(x_BSD)
        logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, self.lm_head[...].astype(dt)).astype(jnp.float32)
        logits_BSV = constrain(logits_BSV, ("batch", "seq", "vocab"))
        return logits_BSV, stats
