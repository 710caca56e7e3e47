"""Decoder-only MoE transformer: embeddings, first-k dense layers, MoE layers, LM head, and
optionally multi-token prediction modules (model/mtp.py, training only).

Shapes: B batch, S sequence, T new tokens (generation), D model, V vocab, L layers of a
stack. Pre-norm residual blocks; the output head is its own weight unless
`model.tie_embeddings` (then the embedding's transpose); bf16 compute (model.dtype) over
float32 master weights. `decode` runs new tokens against a KV cache (model/kv_cache.py),
through the same blocks.

Layers live in two stacks, `dense_layers` and `moe_layers`: one Block's variables
with a leading [L] axis. The forward pass runs each stack as a `jax.lax.scan` over
that axis, so the program (and its compile time) does not grow with depth;
`model.unroll_layers` runs the same parameters through a Python loop instead
(debugging; the same losses). Each block runs under the `model.remat` policy
(xmoe_jax/remat.py). The blocks draw from one RNG stream in order (embedding, dense
layers, MoE layers, head: the order of the per-layer model this replaced; then the
`mtp_layers` stack, so turning MTP on leaves the main model's initial weights as they
were), so initial weights do not depend on the layout. Each stack is created by one
vmapped init (`_stacked`) that draws the same keys as creating its blocks one after
another, so start-up, like compilation, does not grow with depth.

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

from xmoe_jax.config import ModelConfig, ParallelConfig
from xmoe_jax.fp8 import context as fp8_context
from xmoe_jax.model.block import RESIDUAL, Block, constrainer
from xmoe_jax.model.kv_cache import KVCache
from xmoe_jax.model.layers import RMSNorm, dtypes, param
from xmoe_jax.model.loss import chunked_cross_entropy
from xmoe_jax.model.mtp import MTPModule, mtp_loss
from xmoe_jax.moe.stats import MoEStats
from xmoe_jax.remat import remat

STACKS = ("dense_layers", "moe_layers")


class _CountingRngs:
    """Stands in for `nnx.Rngs` while a module is traced abstractly, to count its draws from the
    `params` stream (every weight of the model draws its key there, one key per call)."""

    def __init__(self):
        self.draws = 0

    def params(self) -> jax.Array:
        self.draws += 1
        return jax.random.key(0)


def _stacked(make, rngs: nnx.Rngs, num: int) -> nnx.Module:
    """`num` modules of `make(rngs)` as one module whose variables carry a leading [num] axis,
    created by one vmapped init: its program, and so start-up, does not grow with depth.

    Module i draws the keys that the i-th of `num` calls of `make` one after another would: a
    stream's key j is fold_in(key, count + j), so module i starts at count + i * draws, where
    `draws` is one module's number of keys (counted on an abstract trace). The weights therefore
    equal those of creating the modules in a Python loop; the stream ends where the loop left it.
    One module is created as it is (a batch of one compiles slower than none).
    """
    if num == 1:
        graphdef, state = nnx.split(make(rngs))
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[None], state))
    counter = _CountingRngs()
    graphdef = nnx.split(nnx.eval_shape(lambda: make(counter)))[0]
    stream = rngs.params
    key, count = stream.key[...], stream.count[...]

    def one(i):
        layer_rngs = nnx.Rngs(params=key)
        layer_rngs.params.count[...] = count + i * counter.draws
        return nnx.split(make(layer_rngs))[1]

    state = jax.vmap(one)(jnp.arange(num, dtype=count.dtype))
    stream.count[...] = count + num * counter.draws
    return nnx.merge(graphdef, state)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, parallel: ParallelConfig | None = None):
        _, pdt = dtypes(cfg)
        parallel = parallel or ParallelConfig()
        self.cfg = cfg
        self.parallel = parallel
        # tied, the embedding is also the output head: initialised at init_std like a head
        embed_std = cfg.init_std if cfg.tie_embeddings else 1.0
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden), ("vocab", "embed"), embed_std, pdt)
        if cfg.num_dense_layers:
            self.dense_layers = _stacked(lambda r: Block(cfg, False, r, parallel), rngs, cfg.num_dense_layers)
        if cfg.num_moe_layers:
            self.moe_layers = _stacked(lambda r: Block(cfg, True, r, parallel), rngs, cfg.num_moe_layers)
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, pdt)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.hidden, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pdt)
        if cfg.mtp_depth:
            self.mtp_layers = _stacked(lambda r: MTPModule(cfg, r, parallel), rngs, cfg.mtp_depth)

    def _run_stack(self, stack: Block, x_BSD: jax.Array):
        graphdef, state = nnx.split(stack)

        def layer(x_BSD, layer_state):
            return nnx.merge(graphdef, layer_state)(x_BSD)

        num_layers = jax.tree.leaves(state)[0].shape[0]
        straight_line = self.cfg.unroll_layers or self.cfg.scan_unroll >= num_layers
        layer = remat(layer, self.cfg.remat, straight_line)
        if not self.cfg.unroll_layers:
            return jax.lax.scan(layer, x_BSD, state, unroll=self.cfg.scan_unroll)
        outs = []
        for i in range(num_layers):
            x_BSD, stats = layer(x_BSD, jax.tree.map(lambda a, i=i: a[i], state))
            outs.append(stats)
        return x_BSD, (jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs[0] is not None else None)

    def __call__(self, tokens_BS: jax.Array) -> tuple[jax.Array, dict[str, MoEStats]]:
        """The final-normed hidden states [B,S,D] and the MoE statistics ([L] leaves) keyed by
        the MoE block's module path ("moe_layers/moe")."""
        dt, _ = dtypes(self.cfg)
        constrain = constrainer(self.parallel)
        x_BSD = constrain(jnp.take(self.embed[...], tokens_BS, axis=0).astype(dt), RESIDUAL)
        stats = {}
        with fp8_context.use(self.cfg.fp8):  # the blocks' GEMMs; never the embedding, head or loss
            for name in STACKS:
                if hasattr(self, name):
                    x_BSD, stack_stats = self._run_stack(getattr(self, name), x_BSD)
                    if stack_stats is not None:
                        stats[f"{name}/moe"] = stack_stats
        return self.final_norm(x_BSD), stats

    def decode(self, tokens_BT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Final-normed hidden states [B,T,D] of T new tokens per row, attending to the cache
        (model/kv_cache.py) into which their keys and values are written: prefill and decode."""
        dt, _ = dtypes(self.cfg)
        x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dt)
        kv = {}
        for name in STACKS:
            if not hasattr(self, name):
                continue
            graphdef, state = nnx.split(getattr(self, name))

            def layer(x_BTD, xs, graphdef=graphdef):
                layer_state, k_BSGK, v_BSGK = xs
                x_BTD, view = nnx.merge(graphdef, layer_state).decode(x_BTD, cache.layer(k_BSGK, v_BSGK))
                return x_BTD, (view.k_BSGK, view.v_BSGK)

            x_BTD, kv[name] = jax.lax.scan(layer, x_BTD, (state, *cache.kv[name]))
        return self.final_norm(x_BTD), cache.advanced(kv, tokens_BT.shape[1])

    def head(self) -> jax.Array:
        """The output projection [D,V] in the compute dtype (the embedding's transpose when tied)."""
        dt, _ = dtypes(self.cfg)
        w_DV = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return w_DV.astype(dt)

    def logits(self, h_BSD: jax.Array) -> jax.Array:
        """Float32 logits [B,S,V] of final hidden states (evaluation, generation, tests)."""
        logits_BSV = jnp.einsum("bsd,dv->bsv", h_BSD, self.head()).astype(jnp.float32)
        return constrainer(self.parallel)(logits_BSV, ("batch", "seq", "vocab"))

    def mtp_loss(self, h_BSD: jax.Array, targets_BS: jax.Array) -> tuple[jax.Array, dict[str, MoEStats]]:
        """The multi-token prediction loss (mean over depths, model/mtp.py) from the final-normed
        hidden states, and its modules' MoE statistics ("mtp_layers/block/moe")."""
        loss, stats = mtp_loss(self, h_BSD, targets_BS)
        return loss, ({"mtp_layers/block/moe": stats} if stats is not None else {})

    def loss(self, h_BSD: jax.Array, targets_BS: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy, chunked over the sequence (model.loss_chunk)."""
        return chunked_cross_entropy(
            h_BSD, self.head(), targets_BS, self.cfg.loss_chunk, constrainer(self.parallel)
        )
