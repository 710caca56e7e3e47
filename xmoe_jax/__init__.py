"""xmoe_jax: X-MoE training for DeepSeek-style MoE models in JAX.

Start with `xmoe_jax.moe.moe_layer` (the functional MoE core), `xmoe_jax.config`
(typed configs), `xmoe_jax.sharding` (mesh and logical axis rules) and
`xmoe_jax.train.loop.train` (the trainer). Importing the package changes nothing
in the process: the CLI and the scripts apply the XLA flag defaults
(`xmoe_jax.launch.xla_flags.apply_defaults`) before JAX starts its backend.
"""

from xmoe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, load_config
from xmoe_jax.params import ParamCount, count_params, paper_units

__all__ = [
    "Config",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "ParamCount",
    "count_params",
    "load_config",
    "paper_units",
]
__version__ = "0.1.0"
