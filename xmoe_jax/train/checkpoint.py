"""Checkpoints: a thin wrapper over `orbax.checkpoint.CheckpointManager`.

Each step directory holds four items:

* ``state``  -- the train-state pytree (`StandardSave`): jax.Arrays, possibly sharded over a
  Mesh, plus python / numpy scalars. Restore reshards onto whatever target sharding the caller
  asks for, so a run may resume on a different mesh.
* ``data``   -- the position of a grain `DatasetIterator` (`grain.checkpoint.CheckpointSave`), one
  file per process. Restored only by the same process count: with another count the per-process
  streams differ, so the iterator instead starts at element `step` of this run's own stream (one
  batch per step: as if the run had used this layout from step 1) and a warning is logged.
* ``config`` -- the run's `Config` as JSON (`to_dict`), used by `compat.check_compatible`: a
  resume is refused only when the model config makes different parameters.
* ``manifest`` -- fingerprints of the state's values, checksums of the config and of every
  process's data position (`xmoe_jax.train.integrity`); committed atomically with the rest. It
  also keeps the trainer's own state beside the arrays (`run_state`: the receive buffers' rung,
  moe/ladder.py), so a resumed run starts where its buffers had grown to.

Which step a run resumes from (the newest that reads back and matches its manifest) is
`resume.py`'s; this module saves, lists and restores steps. A restore may name part of the
state (`partial=True`: the weights without the optimizer moments, for the tools); only that part
is read, and checked against the manifest.

RNG keys: store `jax.random.key_data(key)` (a uint32 array) in the state and rebuild the key with
`jax.random.wrap_key_data` after restore; typed key arrays are not plain arrays to orbax.

Saving happens on multiples of `checkpoint.every` (or with `force=True`). Orbax on its own would
also save the first step it is shown; we gate on the interval so that a fresh run does not write a
checkpoint at step 1.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from xmoe_jax.config import CheckpointConfig, Config, to_dict
from xmoe_jax.errors import EXIT_BAD_INPUT, EXIT_FAILED, XmoeError
from xmoe_jax.launch import distributed
from xmoe_jax.storage import first_line as _first_line  # resume.py reads it from here
from xmoe_jax.storage import reason as _storage_reason
from xmoe_jax.train import integrity, writable
from xmoe_jax.train.integrity import IntegrityError
from xmoe_jax.train.integrity import path_str as _path_str

_ITEMS = ("state", "data", "config", "manifest")
log = logging.getLogger("xmoe_jax")


class CheckpointError(XmoeError, RuntimeError):
    """A checkpoint cannot be saved, found or restored; the message names the problem and the fix."""

    exit_code = EXIT_BAD_INPUT


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only or vanished file system); the steps
    saved before it are intact. Raised by `save` or `wait` (an asynchronous save's error)."""

    exit_code = EXIT_FAILED  # failed while running, not bad input


class DamagedCheckpointError(CheckpointError):
    """A checkpoint step exists but does not read back as it was written."""

    def __init__(self, step: int, directory: Path, reason: str):
        self.step, self.reason = step, reason
        super().__init__(f"checkpoint step {step} in {directory} {reason}")


# ----------------------------------------------------------------------------- helpers


def _leaf_shapes(tree: Any, is_leaf: Any = None) -> dict[str, tuple[int, ...]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {_path_str(p): tuple(np.shape(x) if not hasattr(x, "shape") else x.shape) for p, x in leaves}


def _is_meta_leaf(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _advance(data_iter: Any, num: int) -> None:
    """Moves a fresh iterator forward by `num` elements (grain index state if it has one)."""
    state = data_iter.get_state()
    if isinstance(state, dict) and set(state) == {"next_index"}:
        data_iter.set_state({"next_index": state["next_index"] + num})
        return
    for _ in range(num):
        next(data_iter)


# ----------------------------------------------------------------------------- checkpointer


class Checkpointer:
    """Saves and restores (state, data iterator position, config) under `directory`.

    Steps:
      1. `save(step, state, data_iter, config)` on every step; it writes on multiples of
         `ckpt_cfg.every` (async if `ckpt_cfg.async_save`) and keeps the newest `ckpt_cfg.keep`.
      2. On resume: `compat.check_compatible(read_config(), config)`, then
         `restore(abstract_state, data_iter)` where `abstract_state` holds `jax.ShapeDtypeStruct`s
         with the *target* sharding (`resume.py` picks the step).
      3. `close()` (or use as a context manager) to wait for pending writes.
    """

    def __init__(self, directory: str | Path, ckpt_cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.cfg = ckpt_cfg
        # Never removes anything: only creates missing directories.
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=ckpt_cfg.every,
            max_to_keep=ckpt_cfg.keep,
            enable_async_checkpointing=ckpt_cfg.async_save,
            create=True,
        )
        self._write_failed = False
        self.data_fingerprint: dict | None = None  # saved in each manifest (data/fingerprint.py)
        # the trainer's state beside the arrays, saved in each manifest (the buffer ladder's rung:
        # BufferLadder.state), and what the last verified restore held of it
        self.run_state: Callable[[], dict | None] | None = None
        self.restored_run_state: dict | None = None
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=_ITEMS,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(),
                "manifest": ocp.JsonCheckpointHandler(),
            },
        )

    # -- queries

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(
                    f"no checkpoint found in {self.directory}; start without resuming, "
                    "or point train.run_dir at a run that has saved checkpoints"
                )
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; available steps are {steps}"
            )
        return step

    def saved_items(self, step: int) -> dict[str, Any]:
        """Item name -> orbax metadata (None for items without metadata) for items present at `step`."""
        try:
            meta = self._manager.item_metadata(step)
        except Exception as e:  # any metadata failure means the step is unreadable
            raise CheckpointError(
                f"cannot read the metadata of checkpoint step {step} in {self.directory} ({e}); "
                "the step may be incomplete: restore an earlier step"
            ) from e
        return {k: meta[k] for k in _ITEMS if k in meta}

    def saved_state_paths(self, step: int) -> list[str]:
        """Leaf paths ("params/embed", ...) of the state saved at `step` (empty without metadata)."""
        meta = self.saved_items(step).get("state")
        if meta is None:
            return []
        return list(_leaf_shapes(getattr(meta, "tree", meta), is_leaf=_is_meta_leaf))

    def saved_config(self, step: int) -> dict | None:
        """The config dict saved at `step`, None if it was saved without one (config=None)."""
        if "config" not in self.saved_items(self.resolve_step(step)):
            return None
        restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return restored["config"]

    def read_config(self, step: int | None = None) -> dict:
        """The config dict saved at `step` (latest if None)."""
        step = self.resolve_step(step)
        saved = self.saved_config(step)
        if saved is None:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has no saved config; "
                "it was saved with config=None, so pass config= to save() to make it checkable"
            )
        return saved

    # -- save

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `save(step, ..., force=force)` would write a checkpoint."""
        if step in self._manager.all_steps():
            return False
        return force or step % self.cfg.every == 0 or bool(self._manager.reached_preemption(step))

    def save(
        self,
        step: int,
        state: Any,
        data_iter: Any = None,
        config: Config | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Saves on multiples of `checkpoint.every` (any step if `force`); returns whether it saved.

        The data iterator position is captured synchronously, so the caller may advance it at once.
        """
        if not force and step % self.cfg.every != 0 and not self._manager.reached_preemption(step):
            return False
        items: dict[str, Any] = {"state": ocp.args.StandardSave(state)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        if config is not None:
            items["config"] = ocp.args.JsonSave(to_dict(config))
        if step in self._manager.all_steps():
            if not force:
                return False
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self.directory}; orbax never overwrites a "
                "step: delete that step directory by hand or save under a new train.run_dir"
            )
        data_digests = None
        if data_iter is not None:  # every process's position, in process order
            data_digests = distributed.all_gather_text("ckpt-data", integrity.digest(data_iter.get_state()))
        manifest = integrity.build_manifest(
            step,
            state,
            to_dict(config) if config else None,
            data_digests,
            self.data_fingerprint,
            self.run_state() if self.run_state is not None else None,
        )
        items["manifest"] = ocp.args.JsonSave(manifest)
        try:  # a folder that cannot take a file fails here in milliseconds, not in orbax's thread
            writable.probe_write(self.directory)  # (whose error would leave the others waiting 300 s)
            return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=force))
        except Exception as e:  # the write of this step, or the previous asynchronous one, failed
            raise self._write_error(step, e) from e

    def _write_error(self, step: int | None, e: BaseException) -> CheckpointWriteError:
        self._write_failed = True
        thread = getattr(self._manager, "_finalize_thread", None)  # the failed background save, if any
        failed = (
            None
            if thread is None
            else thread.map(lambda t: t.step() if t is not None and t.exception is not None else None)
        )
        step = failed if failed is not None else step
        which = f"step {step}" if step is not None else "a step"
        return CheckpointWriteError(
            f"checkpoint {which} could not be written to {self.directory}: {_storage_reason(e)}. The steps "
            "saved before it are intact (an incomplete step is set aside on --resume); free space or fix "
            "the storage, then run the same command with --resume"
        )

    # -- restore

    def _check_state_layout(self, step: int, state_meta: Any, abstract_state: Any, partial: bool) -> None:
        """Compares leaf paths and shapes with the saved metadata before orbax touches the data
        (`partial`: only under the top-level entries `abstract_state` names)."""
        fix = "restore with the model config the checkpoint was written with, or start a new train.run_dir"
        if state_meta is None:
            return  # no metadata on this orbax version: orbax's own checks apply
        saved = _leaf_shapes(getattr(state_meta, "tree", state_meta), is_leaf=_is_meta_leaf)
        target = _leaf_shapes(abstract_state)
        for path, shape in target.items():
            if path not in saved:
                raise CheckpointError(
                    f"checkpoint step {step} has no leaf '{path}' (abstract_state shape {shape}); {fix}"
                )
            if saved[path] != shape:
                raise CheckpointError(
                    f"shape mismatch at '{path}': checkpoint step {step} has {saved[path]}, "
                    f"abstract_state has {shape}; {fix}"
                )
        named = {p.split("/", 1)[0] for p in target}
        extra = [p for p in saved if p not in target and (not partial or p.split("/", 1)[0] in named)]
        if extra:
            raise CheckpointError(
                f"checkpoint step {step} has leaf '{extra[0]}' (shape {saved[extra[0]]}) that "
                f"abstract_state lacks; {fix}"
            )

    @staticmethod
    def _saved_float_dtypes(state_meta: Any, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(abstract_state with each floating leaf in the dtype it was saved in, {path: target dtype} of
        the leaves that differ). Such leaves (optimizer.state_dtype changed on resume) are read as
        written, so that the manifest checks them, and cast afterwards (`_cast_to_targets`)."""
        if state_meta is None:
            return abstract_state, {}
        leaves = jax.tree_util.tree_flatten_with_path(
            getattr(state_meta, "tree", state_meta), is_leaf=_is_meta_leaf
        )
        saved = {_path_str(p): np.dtype(x.dtype) for p, x in leaves[0] if _is_meta_leaf(x)}
        casts: dict[str, Any] = {}

        def as_saved(path: tuple, x: Any) -> Any:
            was = saved.get(_path_str(path))
            if not isinstance(x, jax.ShapeDtypeStruct) or was is None or was == x.dtype:
                return x
            if not (jnp.issubdtype(was, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)):
                return x  # not a float precision change: orbax's own checks apply
            casts[_path_str(path)] = x.dtype
            return jax.ShapeDtypeStruct(x.shape, was, sharding=x.sharding)

        return jax.tree_util.tree_map_with_path(as_saved, abstract_state), casts

    @staticmethod
    def _cast_to_targets(state: Any, casts: dict[str, Any]) -> Any:
        def cast(path: tuple, x: Any) -> Any:
            dtype = casts.get(_path_str(path))
            return x if dtype is None else x.astype(dtype)

        return jax.tree_util.tree_map_with_path(cast, state)

    @staticmethod
    def _restore_targets(abstract_state: Any) -> Any:
        def target(path: tuple, x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct):
                if x.sharding is None:
                    raise CheckpointError(
                        f"abstract_state leaf '{_path_str(path)}' has no sharding; build it as "
                        "jax.ShapeDtypeStruct(shape, dtype, sharding=<target sharding>)"
                    )
                return x
            if isinstance(x, np.generic):  # orbax restores numpy scalars via 0-d ndarrays
                return np.asarray(x)
            return x

        return jax.tree_util.tree_map_with_path(target, abstract_state)

    def restore(
        self, abstract_state: Any, data_iter: Any = None, step: int | None = None, *, partial: bool = False
    ) -> Any:
        """Restores the state at `step` (latest if None) onto the shardings in `abstract_state`.

        `abstract_state` mirrors the saved state with `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`
        leaves (python / numpy scalars may stand for themselves). The target shardings may differ from
        the saved ones (another mesh, a single device). `data_iter`, if given, is moved in place to the
        saved position. Raises `CheckpointError` if there is no checkpoint or the layout differs, and
        `DamagedCheckpointError` if orbax cannot read the step or it differs from its manifest.
        `partial`: `abstract_state` (a dict) names some of the saved top-level entries (the weights:
        "params" and "bias"); only those are read, and checked against the manifest.
        """
        step = self.resolve_step(step)
        saved = self.saved_items(step)
        if "state" not in saved:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} has no 'state' item")
        self._check_state_layout(step, saved["state"], abstract_state, partial)
        as_saved, casts = self._saved_float_dtypes(saved["state"], abstract_state)
        targets = self._restore_targets(as_saved)
        items: dict[str, Any] = {} if partial else {"state": ocp.args.StandardRestore(targets)}
        restart_data = False
        if data_iter is not None:
            if "data" not in saved:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} holds no data iterator position (it was "
                    "saved with data_iter=None); restore with data_iter=None and rebuild the iterator"
                )
            saved_count = self.data_process_count(step)
            restart_data = saved_count is not None and saved_count != jax.process_count()
            if not restart_data:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        items.update({name: ocp.args.JsonRestore() for name in ("config", "manifest") if name in saved})
        try:
            composite = self._manager.restore(step, args=ocp.args.Composite(**items)) if items else {}
            restored = {name: composite[name] for name in items}
            if partial:
                restored["state"] = self._restore_part(step, targets)
        except Exception as e:  # surface one error type with the step and directory
            raise DamagedCheckpointError(
                step,
                self.directory,
                f"cannot be read ({_first_line(e)}): it is damaged, or abstract_state does not match it "
                "(another model config)",
            ) from e
        self._verify(step, restored, None if restart_data else data_iter, partial)
        if restart_data:
            _advance(data_iter, step)
            log.warning(
                "checkpoint step %d was written by %d process(es), this run has %d: the data position is "
                "per process, so the input restarts at batch %d of this layout's stream (as if it had "
                "run with %d processes from step 1); batches may repeat or be skipped relative to the "
                "saved run",
                step,
                self.data_process_count(step),
                jax.process_count(),
                step,
                jax.process_count(),
            )
        if casts:
            log.info(
                "checkpoint step %d: %d leaves saved in another float dtype (e.g. '%s') cast to %s on restore "
                "(optimizer.state_dtype changed)",
                step,
                len(casts),
                next(iter(casts)),
                sorted({str(d) for d in casts.values()}),
            )
            return self._cast_to_targets(restored["state"], casts)
        return restored["state"]

    def _restore_part(self, step: int, targets: dict) -> dict:
        """The entries of the saved state that `targets` names, and nothing else (orbax's partial
        restore: the optimizer moments are not read when only the weights are asked for)."""
        args = ocp.args.PyTreeRestore(
            targets,
            restore_args=ocp.checkpoint_utils.construct_restore_args(targets),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(self.directory / str(step) / "state", args=args)

    def _verify(self, step: int, restored: Any, data_iter: Any, partial: bool = False) -> None:
        """Checks what was restored against the step's manifest (`integrity`)."""
        self.restored_run_state = None
        if "manifest" not in restored:
            log.warning(
                "checkpoint step %d has no integrity manifest (an older xmoe_jax wrote it): unverified", step
            )
            return
        try:  # every process runs the same checks in the same order (the state check is collective)
            body = integrity.check_manifest(restored["manifest"], step)
            integrity.check_state(body, restored["state"], partial=partial)
            if "config" in restored:
                integrity.check_config(body, restored["config"])
            if data_iter is not None:
                integrity.check_data(body, data_iter.get_state(), jax.process_index())
        except IntegrityError as e:
            raise DamagedCheckpointError(step, self.directory, f"is damaged: {e}") from e
        self.restored_run_state = body.get("run_state")

    def reload_after_main(self) -> None:
        """Every process re-lists the steps after process 0 has moved folders aside (a barrier)."""
        distributed.gather_errors("checkpoint-reload", "")  # a barrier: process 0 has moved things
        self._manager.reload()

    def data_process_count(self, step: int) -> int | None:
        """How many processes wrote the data position at `step` (None if unknown)."""
        files = (self.directory / str(step) / "data").glob("process_*-of-*.json")
        counts = {
            int(m.group(1)) for f in files if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", f.name))
        }
        return counts.pop() if len(counts) == 1 else None

    # -- lifecycle

    def wait(self) -> None:
        """Blocks until pending async saves are on disk; `CheckpointWriteError` if one failed. (Every
        wait inside orbax is bounded by its coordination timeout, 300 s; the probe in `save` finds an
        unwritable folder before orbax waits on it.)"""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_error(None, e) from e

    def close(self) -> None:
        try:
            self._manager.close()
        except Exception as e:
            if not self._write_failed:  # else already reported once
                raise self._write_error(None, e) from e

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
