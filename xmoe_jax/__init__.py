"""xmoe_jax: X-MoE training for DeepSeek-style MoE models in JAX.

Start with `xmoe_jax.moe.moe_layer` (the functional MoE core), `xmoe_jax.config`
(typed configs), `xmoe_jax.sharding` (mesh and logical axis rules) and
`xmoe_jax.train.loop.train` (the trainer).
"""

from xmoe_jax.config import Config, ModelConfig, MoEConfig, load_config
from xmoe_jax.params import ParamCount, count_params, paper_units
from xmoe_jax.xla_flags import apply_defaults as _apply_xla_defaults

_apply_xla_defaults()  # importing jax does not start a backend; flags set now still apply

__all__ = ["Config", "MoEConfig", "ModelConfig", "ParamCount", "count_params", "load_config", "paper_units"]
__version__ = "0.1.0"
