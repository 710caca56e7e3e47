"""Checkpointer: round trips, resharding onto another mesh, retention, interval, data position, config."""

from __future__ import annotations

import dataclasses
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from xmoe_jax.config import CheckpointConfig, Config, ModelConfig, MoEConfig, ParallelConfig, to_dict
from xmoe_jax.train import integrity
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError
from xmoe_jax.train.compat import check_compatible


def _cfg(**kw) -> CheckpointConfig:
    base = {"every": 1, "keep": 10, "async_save": False}
    base.update(kw)
    return CheckpointConfig(**base)


def _state() -> dict:
    return {
        "params": {
            "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7,
            "b": (jnp.arange(5, dtype=jnp.float32) / 3).astype(jnp.bfloat16),
        },
        "opt": {"count": jnp.array(3, jnp.int32), "mu": [jnp.full((2,), -1.5, jnp.float32)]},
        "rng": jax.random.key_data(jax.random.key(42)),  # uint32 RNG key data
        "step": 17,
    }


def _abstract(state, sharding):
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(leaf, state)


def _assert_bitwise_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(
                np.asarray(x).view(np.uint8 if x.dtype.itemsize == 1 else f"u{x.dtype.itemsize}"),
                np.asarray(y).view(np.uint8 if y.dtype.itemsize == 1 else f"u{y.dtype.itemsize}"),
            )
        else:
            assert x == y


def _mesh(shape):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "expert"))


def test_round_trip_bitwise(tmp_path):
    state = _state()
    ck = Checkpointer(tmp_path, _cfg())
    assert ck.latest_step() is None and ck.all_steps() == []
    assert ck.save(5, state)
    dev = SingleDeviceSharding(jax.devices()[0])
    restored = ck.restore(_abstract(state, dev))
    _assert_bitwise_equal(restored, state)
    assert restored["rng"].dtype == jnp.uint32
    key = jax.random.wrap_key_data(restored["rng"])
    np.testing.assert_array_equal(jax.random.key_data(key), state["rng"])
    ck.close()


def test_numpy_scalar_leaf(tmp_path):
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(1, {"x": jnp.ones(2), "n": np.int32(7)})
    out = ck.restore(
        {
            "x": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0])),
            "n": np.int32(0),
        }
    )
    assert int(out["n"]) == 7 and out["n"].dtype == np.int32
    ck.close()


@pytest.mark.parametrize("target", ["mesh_4x2", "single_device"])
def test_restore_onto_different_mesh(tmp_path, target):
    assert len(jax.devices()) >= 8, "tests/conftest.py must fake 8 CPU devices"
    src = NamedSharding(_mesh((2, 4)), P("expert", None))
    w = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), src)
    state = {"w": w, "step": 3}
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(3, state)

    if target == "mesh_4x2":
        dst = NamedSharding(_mesh((4, 2)), P("expert", None))
    else:
        dst = SingleDeviceSharding(jax.devices()[1])
    out = ck.restore({"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=dst), "step": 0})
    assert out["w"].sharding == dst
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(w))
    assert out["step"] == 3
    ck.close()


def test_keep_last_n(tmp_path):
    ck = Checkpointer(tmp_path, _cfg(every=1, keep=2))
    for step in range(1, 5):
        assert ck.save(step, {"x": jnp.full((2,), step)})
    ck.wait()
    assert ck.all_steps() == [3, 4]
    assert ck.latest_step() == 4
    ck.close()


def test_interval_and_force(tmp_path):
    ck = Checkpointer(tmp_path, _cfg(every=10))
    state = {"x": jnp.zeros(2)}
    assert not ck.save(1, state)  # orbax alone would save the first step it sees
    assert not ck.save(5, state)
    assert ck.save(10, state)
    assert not ck.save(15, state)
    assert ck.save(15, state, force=True)
    assert not ck.save(15, state)  # already saved
    assert ck.save(20, state)
    assert ck.all_steps() == [10, 15, 20]
    with pytest.raises(CheckpointError, match="already exists"):
        ck.save(20, state, force=True)  # orbax never overwrites a step
    ck.close()


def test_async_save_then_wait(tmp_path):
    ck = Checkpointer(tmp_path, _cfg(async_save=True))
    state = _state()
    it = iter(grain.MapDataset.range(100).batch(4))
    next(it)
    assert ck.save(2, state, data_iter=it)
    next(it)  # advancing at once must not change what is written
    ck.wait()
    assert ck.all_steps() == [2]
    assert (tmp_path / "2" / "state").is_dir()
    restored = ck.restore(_abstract(state, SingleDeviceSharding(jax.devices()[0])))
    _assert_bitwise_equal(restored, state)
    fresh = iter(grain.MapDataset.range(100).batch(4))
    ck.restore(_abstract(state, SingleDeviceSharding(jax.devices()[0])), data_iter=fresh)
    assert fresh.get_state() == {"next_index": 1}
    ck.close()


def test_existing_content_survives(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(1, {"x": jnp.ones(1)})
    ck.close()
    ck2 = Checkpointer(tmp_path, _cfg())
    assert ck2.all_steps() == [1]
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    ck2.close()


def test_grain_iterator_position(tmp_path):
    ds = grain.MapDataset.range(100).batch(4)
    it = iter(ds)
    for _ in range(3):
        next(it)
    saved_state = it.get_state()
    expected_next = np.asarray(ds[3])  # the 4th batch: [12, 13, 14, 15]

    ck = Checkpointer(tmp_path, _cfg())
    ck.save(3, {"x": jnp.ones(1)}, data_iter=it)
    next(it)  # the saved position must not follow the live iterator

    fresh = iter(ds)
    ck.restore(
        {"x": jax.ShapeDtypeStruct((1,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))},
        data_iter=fresh,
    )
    assert fresh.get_state() == saved_state
    np.testing.assert_array_equal(np.asarray(next(fresh)), expected_next)
    ck.close()


def test_restore_data_iter_without_saved_position(tmp_path):
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(1, {"x": jnp.ones(1)})
    abstract = {"x": jax.ShapeDtypeStruct((1,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
    with pytest.raises(CheckpointError, match="data_iter=None"):
        ck.restore(abstract, data_iter=iter(grain.MapDataset.range(4)))
    ck.close()


def test_config_round_trip_and_compatibility(tmp_path):
    cfg = Config()
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(1, {"x": jnp.ones(1)}, config=cfg)
    saved = ck.read_config()
    assert saved == to_dict(cfg)
    assert ck.read_config(1) == saved
    check_compatible(saved, cfg)

    # Allowed: train/optimizer/checkpoint/data/mesh changes.
    allowed = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=999),
        optimizer=dataclasses.replace(cfg.optimizer, lr=1e-4),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=7),
        data=dataclasses.replace(cfg.data, seed=3),
        mesh=dataclasses.replace(cfg.mesh, expert=2),
    )
    check_compatible(saved, allowed)

    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden=128))
    with pytest.raises(CheckpointError) as e:
        check_compatible(saved, bad)
    msg = str(e.value)
    assert "model.hidden=64" in msg and "model.hidden=128" in msg and "train.run_dir" in msg

    # only changes that alter the parameters are refused: the expert count does, top_k does not
    bad_moe = dataclasses.replace(cfg, model=ModelConfig(moe=MoEConfig(num_experts=16)))
    with pytest.raises(CheckpointError, match=r"model\.moe\.num_experts=8.*model\.moe\.num_experts=16"):
        check_compatible(saved, bad_moe)
    check_compatible(saved, dataclasses.replace(cfg, model=ModelConfig(moe=MoEConfig(top_k=4))))
    # placement is not the model: any dispatch mode resumes
    check_compatible(saved, dataclasses.replace(cfg, parallel=ParallelConfig(dispatch="rbd", ssmb=True)))

    with pytest.raises(CheckpointError, match="model"):
        check_compatible({"train": {}}, cfg)
    ck.close()


def test_read_config_missing(tmp_path):
    ck = Checkpointer(tmp_path, _cfg())
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ck.read_config()
    ck.save(1, {"x": jnp.ones(1)})
    with pytest.raises(CheckpointError, match="config=None"):
        ck.read_config()
    ck.close()


def test_shape_mismatch_names_path(tmp_path):
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(1, {"params": {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}})
    dev = SingleDeviceSharding(jax.devices()[0])

    def sds(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=dev)

    with pytest.raises(CheckpointError, match=r"params/w.*\(4, 8\).*\(4, 16\)"):
        ck.restore({"params": {"w": sds((4, 16)), "b": sds((8,))}})
    with pytest.raises(CheckpointError, match="no leaf 'params/extra'"):
        ck.restore({"params": {"w": sds((4, 8)), "b": sds((8,)), "extra": sds((1,))}})
    with pytest.raises(CheckpointError, match="'params/b'.*abstract_state lacks"):
        ck.restore({"params": {"w": sds((4, 8))}})
    with pytest.raises(CheckpointError, match="no sharding"):
        ck.restore({"params": {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": sds((8,))}})
    ck.close()


def _alter_manifest_leaf(step_dir, path):
    """Gives leaf `path` another fingerprint in the manifest, its own checksum redone: only a read
    of that leaf can tell."""
    meta = step_dir / "manifest" / "metadata"
    manifest = json.loads(meta.read_text())
    manifest["leaves"][path]["fingerprint"] = "0" * 16
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    meta.write_text(json.dumps({**body, "sha256": integrity.digest(body)}))


def test_partial_restore_reads_and_checks_only_the_named_entries(tmp_path):
    """The weights without the optimizer (`load_weights`): the target names only `params`; the rest
    of the saved state is neither read nor checked, what is read is checked leaf by leaf."""
    state = _state()
    dev = SingleDeviceSharding(jax.devices()[0])
    with Checkpointer(tmp_path, _cfg()) as ck:
        ck.save(1, state)
        ck.save(2, state)
    _alter_manifest_leaf(tmp_path / "1", "opt/mu/0")
    _alter_manifest_leaf(tmp_path / "2", "params/w")
    target = {"params": _abstract(state, dev)["params"]}
    with Checkpointer(tmp_path, _cfg()) as ck:
        restored = ck.restore(target, step=1, partial=True)
        assert set(restored) == {"params"}
        _assert_bitwise_equal(restored["params"], state["params"])
        with pytest.raises(DamagedCheckpointError, match="step 1 .*leaf 'opt/mu/0'"):
            ck.restore(_abstract(state, dev), step=1)  # a whole restore reads and checks the moments
        with pytest.raises(DamagedCheckpointError, match="step 2 .*leaf 'params/w'"):
            ck.restore(target, step=2, partial=True)
        with pytest.raises(CheckpointError, match="'params/b'.*abstract_state lacks"):
            ck.restore({"params": {"w": target["params"]["w"]}}, step=1, partial=True)


def test_restore_without_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path / "fresh", _cfg())
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        ck.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32)})
    ck.save(2, {"x": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=r"step 3.*\[2\]"):
        ck.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32)}, step=3)
    ck.close()


def test_float_dtype_change_is_cast_on_restore(tmp_path):
    """optimizer.state_dtype changed on resume: a leaf saved in float32 restores into a bfloat16
    target (and back) as its value cast; the manifest still checks what was written."""
    state = _state()
    dev = SingleDeviceSharding(jax.devices()[0])
    with Checkpointer(tmp_path, _cfg()) as ck:
        ck.save(1, state)
        target = _abstract(state, dev)
        target["opt"]["mu"] = [jax.ShapeDtypeStruct((2,), jnp.bfloat16, sharding=dev)]
        restored = ck.restore(target)
        assert restored["opt"]["mu"][0].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(restored["opt"]["mu"][0], np.float32), [-1.5, -1.5])
        _assert_bitwise_equal(restored["params"], state["params"])
        ck.save(2, restored)
        restored = ck.restore(_abstract(state, dev), step=2)  # bfloat16 on disk, float32 target
        assert restored["opt"]["mu"][0].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(restored["opt"]["mu"][0]), [-1.5, -1.5])


def test_the_trainers_run_state_travels_in_the_manifest(tmp_path):
    """The buffer ladder's rung rides in each checkpoint's manifest (covered by its checksum) and comes
    back with a verified restore; a checkpoint without it restores as before."""
    state = _state()
    dev = SingleDeviceSharding(jax.devices()[0])
    ck = Checkpointer(tmp_path, _cfg())
    ck.save(1, state)  # no run state (a run without the ladder, or an older xmoe_jax)
    rung = {"recv_buffer_factor": 2.5}
    ck.run_state = lambda: dict(rung)
    ck.save(2, state)
    rung["recv_buffer_factor"] = None  # the worst case, later
    ck.save(3, state)
    for step, want in ((2, {"recv_buffer_factor": 2.5}), (1, None), (3, {"recv_buffer_factor": None})):
        ck.restore(_abstract(state, dev), step=step)
        assert ck.restored_run_state == want, step
    manifest = json.loads((tmp_path / "2" / "manifest" / "metadata").read_text())
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    assert body["run_state"] == {"recv_buffer_factor": 2.5} and integrity.digest(body) == manifest["sha256"]
    ck.close()
