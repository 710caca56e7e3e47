"""XMOE_SCAN_STACKS=empty (launch/scan_stacks.py): a scan's stacked outputs start from `lax.empty`
(XLA's AllocateBuffer on GPU) instead of a broadcast of zeros, with the same results.

Checked here without a GPU: the CUDA export of a differentiated layer scan inside shard_map holds
AllocateBuffer with the switch and not without, and the CPU results are equal either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from xmoe_jax.launch import scan_stacks


@pytest.fixture
def restore():
    yield
    scan_stacks.apply("zeros")


def _mesh():
    return jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _placed(w, x):
    mesh = _mesh()
    return (
        jax.device_put(w, jax.sharding.NamedSharding(mesh, P())),
        jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data"))),
    )


def _layers_loss(w_LDD, x_BD):
    """A scanned stack of tanh layers under grad: its residuals are the scan's stacked outputs."""

    def body(h, w):
        return jnp.tanh(h @ w), None

    def loss(w, x):
        return jnp.sum(jax.lax.scan(body, x, w)[0] ** 2)

    mesh = _mesh()
    fn = jax.shard_map(
        lambda w, x: jax.lax.psum(jax.grad(loss)(w, x), "data"),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P(),
    )
    return jax.jit(fn)


def _cuda_text(w, x) -> str:
    return jax.export.export(_layers_loss(w, x), platforms=["cuda"])(w, x).mlir_module()


def test_empty_stacks_allocate_without_a_fill_and_compute_the_same(restore):
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 8, 8)) / 3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    w, x = _placed(w, x)
    want = np.asarray(_layers_loss(w, x)(w, x))
    assert "AllocateBuffer" not in _cuda_text(w, x)

    assert scan_stacks.apply("empty")
    assert "AllocateBuffer" in _cuda_text(w, x)
    np.testing.assert_array_equal(np.asarray(_layers_loss(w, x)(w, x)), want)

    assert not scan_stacks.apply("zeros")
    assert "AllocateBuffer" not in _cuda_text(w, x)


def test_a_bad_mode_is_refused_with_the_choices(monkeypatch, restore):
    monkeypatch.setenv("XMOE_SCAN_STACKS", "uninit")
    with pytest.raises(ValueError, match=r"use one of \('zeros', 'empty'\)"):
        scan_stacks.apply_from_env()
    monkeypatch.setenv("XMOE_SCAN_STACKS", "empty")
    assert scan_stacks.apply_from_env()
