"""Typed, validated configuration.

One frozen dataclass per component; each validates itself on construction and raises
`ConfigError` naming the field and the fix. `load_config` reads a YAML file (nested mappings
mirror the dataclasses) and applies dotted overrides such as ``model.moe.top_k=4``. Unknown keys
and wrong types are errors, never ignored.

The rooms (import from here; the modules are the layout, not the interface):
    choices.py   the `Literal` value sets (Dispatch, RematMode, ...)
    checks.py    the validation helpers (`_check`, `_check_choices`, `_check_numbers`)
    model.py     ModelConfig, MoEConfig, MLAConfig, RopeScalingConfig, FP8Config
    parallel.py  ParallelConfig, MeshConfig, MeshShape: placement, not the model
    data.py      DataConfig, SourceConfig, EvalConfig
    run.py       OptimizerConfig, CheckpointConfig, TrainConfig and Config (cross-section checks)
    loading.py   from_dict / to_dict, migrate_dict, dotted overrides, load_config
    yaml_io.py   YAML files and `--set` values, errors with file:line:col

Importing this package imports no JAX: the CLI loads the config before JAX starts.
"""

from xmoe_jax.config.choices import DISPATCH_MODES, TRANSPORTS
from xmoe_jax.config.data import DataConfig, EvalConfig, SourceConfig
from xmoe_jax.config.loading import (
    MOVED_TO_PARALLEL,
    from_dict,
    load_config,
    migrate_dict,
    override_dict,
    parse_overrides,
    to_dict,
)
from xmoe_jax.config.model import FP8Config, MLAConfig, ModelConfig, MoEConfig, RopeScalingConfig
from xmoe_jax.config.parallel import MeshConfig, MeshShape, ParallelConfig
from xmoe_jax.config.run import CheckpointConfig, Config, OptimizerConfig, TrainConfig, check_groups_by_node
from xmoe_jax.errors import ConfigError

__all__ = [
    "DISPATCH_MODES",
    "MOVED_TO_PARALLEL",
    "TRANSPORTS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FP8Config",
    "MLAConfig",
    "MeshConfig",
    "MeshShape",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RopeScalingConfig",
    "SourceConfig",
    "TrainConfig",
    "check_groups_by_node",
    "from_dict",
    "load_config",
    "migrate_dict",
    "override_dict",
    "parse_overrides",
    "to_dict",
]
