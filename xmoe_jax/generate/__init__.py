"""Text generation from a checkpoint: KV-cached prefill and decode (engine.py) and sampling
(sampling.py). Text <-> ids is the run's tokenizer (xmoe_jax/data/tokenizer.py), which the
CLI's `xmoe-generate` loads."""

from xmoe_jax.generate.engine import generate, generate_from_run, generation_config
from xmoe_jax.generate.sampling import SamplingConfig, sample

__all__ = ["SamplingConfig", "generate", "generate_from_run", "generation_config", "sample"]
