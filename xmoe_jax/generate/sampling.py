"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

Shapes: B rows, V vocab. Steps, in float32:
  1. temperature 0: argmax (greedy), nothing else applies;
  2. logits / temperature;
  3. top_k > 0: logits below the k-th largest become -inf;
  4. top_p < 1: keep the smallest set of most likely tokens whose probability reaches p
     (a token is kept when the mass of the tokens before it is below p, so the first always is);
  5. one categorical draw per row with the step's key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from xmoe_jax.config import ConfigError

# logits / temperature in float32: 1e-3 scales logits of up to ~1e35 without overflow (1e-45, a
# denormal, turned every logit into +-inf and every draw into token 0)
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0  # 1 = all tokens

    def __post_init__(self) -> None:
        t = self.temperature
        if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t)):
            raise ConfigError(
                f"--temperature={t} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (below it the "
                "scaled logits overflow float32); use 0 for the most likely token"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"--top-k={self.top_k} must be a whole number >= 0 (0 = no top-k cut)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"--top-p={self.top_p} must be in (0, 1] (1 = no nucleus cut)")


def sample(logits_BV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """int32 [B] next tokens (steps 1-5 of the module docstring)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if cfg.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / cfg.temperature
    if cfg.top_k:
        kth_B1 = jax.lax.top_k(logits_BV, min(cfg.top_k, logits_BV.shape[-1]))[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if cfg.top_p < 1:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        keep_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < cfg.top_p
        cut_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cut_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)
