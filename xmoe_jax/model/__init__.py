"""The Flax NNX model and its functional wrapper (split/merge, logical axes, init)."""

from xmoe_jax.model.functional import ModelSpec, apply, init_params, model_spec, shardings
from xmoe_jax.model.transformer import Transformer

__all__ = ["ModelSpec", "Transformer", "apply", "init_params", "model_spec", "shardings"]
