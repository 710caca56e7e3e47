"""The functional MoE core on its own: one layer, the dense oracle and pft on 8 devices.

    python examples/moe_layer.py        # CPU is fine: 8 fake devices, well under a minute

The README's "The MoE core" shows the part between the `README` marks as it stands here, and
`tests/test_examples.py` checks that and runs this file. What it prints:
  1. dropless (`capacity_factor=None`), pft on 8 devices computes the dense oracle's values;
  2. dropping (`capacity_factor=1.25`), each expert keeps at most C = ceil(cf * T * k / E) copies,
     but T differs by mode: `dense` and `padded` see the whole batch (one C for all its tokens),
     while `pft` and `rbd` run per device inside a shard_map and count T per source shard (as
     X-MoE does): on 8 token shards they drop other (more) copies than `dense`, the same ones as
     each other;
  3. on a mesh that keeps the tokens on one shard, pft drops exactly dense's copies.
"""

from __future__ import annotations

# README begin
import os

# 8 fake CPU devices, set before JAX starts (a fresh Python; a GPU host needs 8 GPUs of its own)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax  # noqa: E402

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig  # noqa: E402
from xmoe_jax.moe import init_moe_params, moe_layer  # noqa: E402
from xmoe_jax.sharding import make_mesh  # noqa: E402

cfg = MoEConfig(num_experts=64, top_k=6, expert_hidden=128)  # what it computes (dropless)
params = init_moe_params(jax.random.key(0), 256, cfg)  # model width D = 256
x_TD = jax.random.normal(jax.random.key(1), (512, 256))  # T = 512 tokens
y_TD, stats = moe_layer(params, x_TD, cfg)  # the dense oracle, one device
with jax.set_mesh(make_mesh(MeshConfig(expert=8))):  # the ambient mesh places it: 8 experts a device
    pft = jax.jit(lambda p, x: moe_layer(p, x, cfg, ParallelConfig(dispatch="pft")))
    y_pft_TD, stats_pft = pft(params, x_TD)  # the same values (dropless)
# README end
import numpy as np  # noqa: E402


def max_diff(a: jax.Array, b: jax.Array) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))  # on the host: meshes differ


def run(cfg: MoEConfig, dispatch: str, mesh) -> tuple[jax.Array, int]:
    """(y_TD, dropped copies) of one layer placed on `mesh`."""
    with jax.set_mesh(mesh):
        y_TD, stats = jax.jit(lambda p, x: moe_layer(p, x, cfg, ParallelConfig(dispatch=dispatch)))(
            params, x_TD
        )
    return y_TD, int(stats.num_dropped)


T = x_TD.shape[0]
print(f"dropless: pft on 8 devices vs dense, max |diff| = {max_diff(y_pft_TD, y_TD):.1e}")
dropping = MoEConfig(num_experts=64, top_k=6, expert_hidden=128, capacity_factor=1.25)
print(
    f"dropping: C = {dropping.capacity(T)} per expert for all {T} tokens, "
    f"{dropping.capacity(T // 8)} per expert and 8-way token shard"
)
ep8 = make_mesh(MeshConfig(expert=8))
one_shard = make_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
ref, ref_dropped = run(dropping, "dense", ep8)
for dispatch, mesh, where in [
    ("padded", ep8, "8 devices"),
    ("pft", ep8, "8 devices"),
    ("rbd", ep8, "8 devices"),
    ("pft", one_shard, "one token shard"),
]:
    y, dropped = run(dropping, dispatch, mesh)
    print(
        f"  {dispatch} on {where}: dropped {dropped} (dense: {ref_dropped}), "
        f"max |diff| vs dense = {max_diff(y, ref):.1e}"
    )
