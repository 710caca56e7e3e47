"""The key/value cache of generation, stacked like the layers so it rides through their scan.

Shapes: L layers of a stack, B rows (prompts), S cache slots (the static maximum length),
T new tokens of one step, G key/value heads, K head dim, H query heads.

Prompts of different lengths are left-padded: row b's real tokens fill slots
first_B[b] .. and every row writes its next token at the same slot (`index`), so one
`dynamic_update_slice` serves the batch. A row's RoPE positions count from its first
real token (slot - first_B[b]), so a padded prompt is computed exactly as the same
prompt alone. A query at slot i of row b sees slots j with first_B[b] <= j <= i (a
padding slot sees only itself, which keeps its values finite: they are never read).

Multi-head latent attention (model/mla.py) caches what DeepSeek's inference caches: the
compressed latent c [B,S,1,C] in the key slot and the shared RoPE key [B,S,1,R] in the value
slot (C + R numbers per token and layer instead of 2*G*K; one "head", never split over tensor).

    cache = init_cache(cfg, batch, max_len, first_B)   # zeros, index 0
    h_BTD, cache = model.decode(tokens_BT, cache)      # writes T slots, index += T
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.config import ModelConfig
from xmoe_jax.model.layers import KV_NAMES, dtypes


class LayerCache(NamedTuple):
    """One layer's cache during one step of T new tokens."""

    k_BSGK: jax.Array
    v_BSGK: jax.Array
    index: jax.Array  # int32 []: the slot of the step's first token
    first_B: jax.Array  # int32 [B]: each row's first real slot

    def positions(self, num_new: int) -> jax.Array:
        """RoPE positions [B,T] of `num_new` tokens written at `index` (padding slots clamp to 0)."""
        slots_BT = self.index + jnp.arange(num_new)[None, :]
        return jnp.maximum(slots_BT - self.first_B[:, None], 0)

    def write(self, k_BTGK: jax.Array, v_BTGK: jax.Array) -> LayerCache:
        """Stores the new keys and values at slots index .. index + T - 1."""
        at = (0, self.index, 0, 0)
        k = jax.lax.dynamic_update_slice(self.k_BSGK, k_BTGK.astype(self.k_BSGK.dtype), at)
        v = jax.lax.dynamic_update_slice(self.v_BSGK, v_BTGK.astype(self.v_BSGK.dtype), at)
        return self._replace(k_BSGK=k, v_BSGK=v)

    def mask_BTS(self, num_new: int) -> jax.Array:
        """Which slots each of `num_new` queries written at `index` sees (module docstring)."""
        q_slot_1T1 = (self.index + jnp.arange(num_new))[None, :, None]
        key_slot_11S = jnp.arange(self.k_BSGK.shape[1])[None, None, :]
        first_B11 = self.first_B[:, None, None]
        return (key_slot_11S <= q_slot_1T1) & ((key_slot_11S >= first_B11) | (key_slot_11S == q_slot_1T1))

    def attend(self, q_BTHK: jax.Array) -> jax.Array:
        """Softmax attention (scale 1/sqrt(K)) of the new queries over the visible slots."""
        mask_BTS = self.mask_BTS(q_BTHK.shape[1])
        return jax.nn.dot_product_attention(q_BTHK, self.k_BSGK, self.v_BSGK, mask=mask_BTS[:, None])


class KVCache(NamedTuple):
    """Keys and values of every layer, per layer stack: name -> (k [L,B,S,G,K], v [L,B,S,G,K])."""

    kv: dict[str, tuple[jax.Array, jax.Array]]
    index: jax.Array  # int32 []: the next slot to write (shared by all rows)
    first_B: jax.Array  # int32 [B]: each row's first real slot (its left padding)

    def layer(self, k_BSGK: jax.Array, v_BSGK: jax.Array) -> LayerCache:
        return LayerCache(k_BSGK, v_BSGK, self.index, self.first_B)

    def advanced(self, kv: dict, num_new: int) -> KVCache:
        return KVCache(kv, self.index + num_new, self.first_B)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, first_B: jax.Array, constrain=None) -> KVCache:
    """Zeros in the compute dtype for `max_len` slots; `constrain` (logical names -> mesh) places
    the rows like the batch and the key/value heads like the attention's (MLA: the latent and the
    RoPE key, module docstring)."""
    dt, _ = dtypes(cfg)
    if cfg.mla is not None:
        shapes = [(batch, max_len, 1, cfg.mla.kv_lora_rank), (batch, max_len, 1, cfg.mla.qk_rope_head_dim)]
        names = ("batch", None, None, None)
    else:
        shapes = [(batch, max_len, cfg.kv_heads, cfg.head_size)] * 2
        names = KV_NAMES
    kv = {}
    for name, num_layers in (("dense_layers", cfg.num_dense_layers), ("moe_layers", cfg.num_moe_layers)):
        if num_layers:
            pair = [jnp.zeros((num_layers, *shape), dt) for shape in shapes]
            if constrain is not None:
                pair = [constrain(a, (None, *names)) for a in pair]
            kv[name] = tuple(pair)
    return KVCache(kv, jnp.zeros((), jnp.int32), jnp.asarray(first_B, jnp.int32))
