"""Checkpoint integrity on small states (no model): every kind of damage to the newest step is
found and the resume falls back to the previous step; with nothing intact it stops naming each
step's problem and moves nothing; fingerprints do not depend on the layout."""

from __future__ import annotations

import json
import logging
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from xmoe_jax.config import CheckpointConfig
from xmoe_jax.train import integrity, resume
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError


def _state(step: int) -> dict:
    return {"w": jnp.arange(4096, dtype=jnp.float32) * step, "step": jnp.int32(step)}


def _abstract() -> dict:
    dev = SingleDeviceSharding(jax.devices()[0])
    return {
        "w": jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=dev),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=dev),
    }


def _saved(directory, steps=(1, 2)) -> Checkpointer:
    ck = Checkpointer(directory, CheckpointConfig(every=1, keep=5, async_save=False))
    data = iter(grain.MapDataset.range(100))
    for step in steps:
        next(data)
        ck.save(step, _state(step), data)
    ck.close()
    return Checkpointer(directory, CheckpointConfig(every=1, keep=5, async_save=False))


def _largest(path):
    return max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "bit flip in an array file": lambda d: _flip(_largest(d / "state")),
    "truncated array file": lambda d: _largest(d / "state").write_bytes(
        _largest(d / "state").read_bytes()[:100]
    ),
    "deleted array file": lambda d: _largest(d / "state").unlink(),
    "deleted data position": lambda d: (d / "data" / "process_0-of-1.json").unlink(),
    "deleted manifest": lambda d: shutil.rmtree(d / "manifest"),
    "altered manifest": lambda d: (d / "manifest" / "metadata").write_text(
        (d / "manifest" / "metadata").read_text().replace('"step": 2', '"step": 3')
    ),
    "altered data position": lambda d: (d / "data" / "process_0-of-1.json").write_text(
        json.dumps({"next_index": 7})
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_step_falls_back_to_the_previous_one(tmp_path, damage, caplog):
    ck = _saved(tmp_path)
    DAMAGE[damage](tmp_path / "2")
    data = iter(grain.MapDataset.range(100))
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        step, state = resume.find(ck).restore_first_intact(ck, _abstract(), data)
    assert step == 1 and int(state["step"]) == 1 and data.get_state() == {"next_index": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4096, dtype=np.float32))
    assert f"checkpoint step 2 in {tmp_path}" in caplog.text or f"checkpoint {tmp_path / '2'}" in caplog.text
    assert (tmp_path / "rejected" / "2").is_dir() and ck.all_steps() == [1]  # moved aside, not deleted
    ck.close()


def test_nothing_intact_stops_naming_each_step_and_moves_nothing(tmp_path):
    ck = _saved(tmp_path)
    for step in ("1", "2"):
        _flip(_largest(tmp_path / step / "state"))
    with pytest.raises(CheckpointError) as err:
        resume.find(ck).restore_first_intact(ck, _abstract(), None)
    msg = str(err.value)
    assert f"no checkpoint in {tmp_path} restores intact" in msg and "step 2 is damaged" in msg
    assert "step 1 is damaged" in msg and "Nothing was moved or deleted" in msg and "new train.run_dir" in msg
    assert ck.all_steps() == [1, 2] and not (tmp_path / "rejected").exists()
    ck.close()


def test_interrupted_saves_are_moved_aside_and_logged(tmp_path, caplog):
    ck = _saved(tmp_path, steps=(1,))
    partial = tmp_path / "2.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, "xmoe_jax"):
        assert resume.find(ck).steps == [1]
    assert "is an interrupted save that never completed" in caplog.text
    assert (tmp_path / "rejected" / partial.name / "state").is_dir() and not partial.exists()
    ck.close()


def test_direct_restore_of_a_damaged_step_raises(tmp_path):
    ck = _saved(tmp_path)
    _flip(_largest(tmp_path / "2" / "state"))
    with pytest.raises(DamagedCheckpointError, match="leaf 'w' has another fingerprint"):
        ck.restore(_abstract(), step=2)
    ck.close()


def test_fingerprints_do_not_depend_on_the_layout_and_catch_every_bit():
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 7
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    table = integrity.leaf_table({"x": x})
    for spec in (P("a", "b"), P("b", None), P(None, ("a", "b"))):
        assert integrity.leaf_table({"x": jax.device_put(x, NamedSharding(mesh, spec))}) == table
    bits = np.asarray(x).view(np.uint32).copy()
    seen = {table["x"]["fingerprint"]}
    for bit in range(32):  # every single-bit flip of one element changes the fingerprint
        flipped = bits.copy()
        flipped[3, 4] ^= np.uint32(1 << bit)
        seen.add(integrity.leaf_table({"x": jnp.asarray(flipped.view(np.float32))})["x"]["fingerprint"])
    assert len(seen) == 33
    assert integrity.leaf_table({"s": 17})["s"]["dtype"] == "int32"  # python scalars as jax sees them
