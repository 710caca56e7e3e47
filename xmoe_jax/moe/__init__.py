"""Functional MoE core: `moe_layer(params, x_TD, cfg, parallel)`.

Files: layer.py (the public layer), body.py (route, keep, dispatch, statistics),
dispatchers.py (the table of dispatch modes), placement.py (the block's shard_map),
router.py, capacity.py, experts.py, dense.py / padded.py / pft.py / rbd.py (dispatch
paths), exchange.py (the padding-free exchange), transports.py (the table of transports),
stages.py, stats.py, params.py.
"""

from xmoe_jax.moe.layer import moe_layer
from xmoe_jax.moe.params import init_moe_params
from xmoe_jax.moe.stats import MoEStats

__all__ = ["MoEStats", "init_moe_params", "moe_layer"]
