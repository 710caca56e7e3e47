"""Text generation from a checkpoint: KV-cached prefill and decode (engine.py), sampling
(sampling.py), and the text <-> ids functions of the CLI (text.py)."""

from xmoe_jax.generate.engine import generate, generate_from_run, generation_config
from xmoe_jax.generate.sampling import SamplingConfig, sample

__all__ = ["SamplingConfig", "generate", "generate_from_run", "generation_config", "sample"]
