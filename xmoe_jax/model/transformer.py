"""Decoder-only MoE transformer: embeddings, first-k dense layers, MoE layers, LM head.

Shapes: B batch, S sequence, D model, V vocab. Pre-norm residual blocks; untied
embedding and output head; bf16 compute (model.dtype) over float32 master weights.

The residual stream is laid out ("batch", "residual_seq", "embed"): batch over the
token axes and, with `model.sequence_parallel`, the sequence split over the tensor
axis, so norms and residual adds run on 1/TP of the tokens and attention / MLPs
gather the sequence and reduce-scatter their row-parallel outputs back. An SSMB MoE
block takes that layout as is (its tokens are split the same way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from xmoe_jax import sharding
from xmoe_jax.config import ModelConfig
from xmoe_jax.model.layers import MLP, Attention, RMSNorm, dtypes, param
from xmoe_jax.model.moe_block import MoEBlock

RESIDUAL = ("batch", "residual_seq", "embed")


def _constrainer(cfg: ModelConfig, mesh: Mesh | None):
    return sharding.constrainer(mesh, sharding.activation_rules(sequence_parallel=cfg.sequence_parallel))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, is_moe: bool, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.is_moe = is_moe
        self.cfg = cfg
        if is_moe:
            self.moe = MoEBlock(cfg, rngs)
        else:
            self.mlp = MLP(cfg.hidden, cfg.dense_hidden, cfg.dense_activation, cfg, rngs)

    def __call__(self, x_BSD: jax.Array, mesh: Mesh | None) -> tuple[jax.Array, dict | None]:
        constrain = _constrainer(self.cfg, mesh)
        x_BSD = x_BSD + constrain(self.attn(self.attn_norm(x_BSD), constrain), RESIDUAL)
        h_BSD = self.mlp_norm(x_BSD)
        if self.is_moe:
            y_BSD, aux = self.moe(h_BSD, mesh)
        else:
            y_BSD, aux = self.mlp(h_BSD, constrain), None
        x_BSD = constrain(x_BSD + y_BSD, RESIDUAL)
        return x_BSD, aux


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden), ("vocab", "embed"), 1.0, pdt)
        self.layers = nnx.Dict(
            {f"layer_{i:03d}": Block(cfg, i >= cfg.num_dense_layers, rngs) for i in range(cfg.num_layers)}
        )
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        self.lm_head = param(rngs, (cfg.hidden, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pdt)

    def __call__(self, tokens_BS: jax.Array, mesh: Mesh | None = None) -> tuple[jax.Array, dict]:
        """Float32 logits [B,S,V] and the MoE aux values stacked over MoE layers."""
        dt, _ = dtypes(self.cfg)
        constrain = _constrainer(self.cfg, mesh)
        x_BSD = constrain(jnp.take(self.embed[...], tokens_BS, axis=0).astype(dt), RESIDUAL)
        auxes = []
        for name in sorted(self.layers.keys()):
            x_BSD, aux = self.layers[name](x_BSD, mesh)
            if aux is not None:
                auxes.append(aux)
        x_BSD = self.final_norm(x_BSD)
        logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, self.lm_head[...].astype(dt)).astype(jnp.float32)
        logits_BSV = constrain(logits_BSV, ("batch", "seq", "vocab"))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else {}
        return logits_BSV, stacked
