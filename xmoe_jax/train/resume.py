"""Resume selection: which checkpoint step a run continues from, or whether it starts fresh.

  1. `select(cfg, run, resume, ckpt)`: without `--resume`, a run directory that already holds a
     run is refused (never written over); with it, the steps to try (`find`), or a fresh start
     where that cannot write over a run that could never be resumed or trained another model;
  2. `find(ckpt)`: the steps whose metadata, manifest and config check out, newest first
     (`Candidates`). Temporary folders of interrupted saves are moved aside at once; steps that
     fail are logged and kept until an older step has restored. Process 0 decides; every process
     gets the same answer (the coordination service carries it);
  3. `Candidates.restore_first_intact`: the first of them that restores and matches its manifest;
     the newer steps that did not are then moved aside. If none does, the run stops naming each
     step's problem, moving nothing.
Whether the config may continue the chosen step is `compat.check_compatible`'s question.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax

from xmoe_jax.config import Config, ConfigError, to_dict
from xmoe_jax.launch import distributed
from xmoe_jax.train import integrity
from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError, _first_line
from xmoe_jax.train.integrity import IntegrityError
from xmoe_jax.train.rundir import RunDir

log = logging.getLogger("xmoe_jax")


@dataclasses.dataclass
class Candidates:
    """Steps to resume from, newest first ([]: a fresh start), and why each other step cannot be."""

    steps: list[int] = dataclasses.field(default_factory=list)
    damaged: dict[int, str] = dataclasses.field(default_factory=dict)  # step -> reason

    def __bool__(self) -> bool:
        return bool(self.steps)

    @property
    def newest(self) -> int | None:
        return self.steps[0] if self.steps else None

    def restore_first_intact(
        self, ckpt: Checkpointer, abstract_state: Any, data_iter: Any
    ) -> tuple[int, Any]:
        """(step, state) of the first step that restores and matches its manifest.

        Once one has, the newer steps that did not are moved aside (process 0), and every process
        reloads its step list. If none does, raises `CheckpointError` naming each step's problem.
        """
        for step in self.steps:
            error, state = "", None
            try:
                state = ckpt.restore(abstract_state, data_iter, step)
            except DamagedCheckpointError as e:
                error = e.reason
            errors = distributed.gather_errors("restore", error)
            if not errors:
                if jax.process_index() == 0:
                    for newer in sorted(s for s in ckpt.all_steps() if s > step):
                        integrity.reject(ckpt.directory, str(newer), self.damaged.get(newer, "damaged"))
                ckpt.reload_after_main()
                return step, state
            reasons = set(errors.values())
            self.damaged[step] = (
                reasons.pop()
                if len(reasons) == 1
                else "; ".join(f"process {i}: {e}" for i, e in errors.items())
            )
            log.warning(
                "checkpoint step %d in %s %s; trying an older step", step, ckpt.directory, self.damaged[step]
            )
        raise CheckpointError(_nothing_intact(ckpt, self.damaged))


def _quick_check(ckpt: Checkpointer, step: int, manifest_expected: bool) -> None:
    """What can be checked without the arrays: metadata, manifest, config (raises if damaged)."""
    saved = ckpt.saved_items(step)
    if "state" not in saved:
        raise IntegrityError("it has no state item")
    if "manifest" not in saved:
        if manifest_expected:  # an older step has one, so this version wrote this step too
            raise IntegrityError("its manifest is missing")
        return  # written before manifests existed: `restore` says it is unverified
    try:  # read directly: orbax's restore is collective, and only process 0 runs this
        manifest, config = (
            json.loads((ckpt.directory / str(step) / name / "metadata").read_text())
            if name in saved
            else None
            for name in ("manifest", "config")
        )
    except (OSError, ValueError) as e:
        raise IntegrityError(f"its manifest or config cannot be read ({_first_line(e)})") from e
    body = integrity.check_manifest(manifest, step)
    if config is not None:
        integrity.check_config(body, config)


def find(ckpt: Checkpointer) -> Candidates:
    """The steps to resume from, newest first: those whose metadata, manifest and config check out.

    Moves the temporary folders of interrupted saves aside first. Steps that fail are logged and
    kept until an older one restores (`Candidates.restore_first_intact`). Process 0 decides; every
    process gets the same list. Raises `CheckpointError` if steps exist but none checks out.
    """
    verdict = ""
    if jax.process_index() == 0:
        for path in integrity.partial_saves(ckpt.directory):
            integrity.reject(ckpt.directory, path.name, "is an interrupted save that never completed")
        good, bad = [], {}
        steps = ckpt.all_steps()
        with_manifest = [(ckpt.directory / str(s) / "manifest").is_dir() for s in steps]
        for i in reversed(range(len(steps))):
            step = steps[i]
            try:
                _quick_check(ckpt, step, manifest_expected=any(with_manifest[:i]))
                good.append(step)
            except (CheckpointError, IntegrityError) as e:
                bad[step] = f"is damaged: {e}"
                log.warning("checkpoint step %d in %s %s", step, ckpt.directory, bad[step])
        verdict = json.dumps({"good": good, "bad": bad})
    shared = json.loads(distributed.share_from_main("resume-candidates", verdict))
    ckpt.reload_after_main()
    found = Candidates(shared["good"], {int(k): v for k, v in shared["bad"].items()})
    if not found and found.damaged:
        raise CheckpointError(_nothing_intact(ckpt, found.damaged))
    return found


def _nothing_intact(ckpt: Checkpointer, damaged: dict[int, str]) -> str:
    problems = "; ".join(f"step {s} {why}" for s, why in sorted(damaged.items(), reverse=True))
    return (
        f"no checkpoint in {ckpt.directory} restores intact ({problems}). Nothing was moved or deleted. "
        "Put back an intact copy of a step folder, move the damaged step folders out of that directory "
        "to resume from an older step, or start over in a new train.run_dir"
    )


def select(cfg: Config, run: RunDir, resume: bool, ckpt: Checkpointer | None) -> Candidates:
    """The steps to resume from, newest first (none: a fresh start); refuses to overwrite a run."""
    if resume:  # reliability: only steps whose metadata and manifest check out
        candidates = find(ckpt) if ckpt is not None else Candidates()
        if not candidates:
            _check_nothing_to_resume(cfg, run)
            log.info("no checkpoint in %s: starting at step 0", run.checkpoints)
        return candidates
    latest = ckpt.latest_step() if ckpt is not None else None
    if latest is not None:
        raise ConfigError(
            f"{run} already holds a run (checkpoint at step {latest}); pass --resume to continue "
            "it or set train.run_dir to a new directory"
        )
    if run.metrics.exists():
        raise ConfigError(
            f"{run} already holds metrics.jsonl from another run; set train.run_dir to a new "
            "directory (or pass --resume to append)"
        )
    return Candidates()


def _check_nothing_to_resume(cfg: Config, run: RunDir) -> None:
    """`--resume` found no checkpoint: start at step 0, unless that would write over a run that
    never could be resumed (it saved no checkpoints) or that trained another model."""
    saved = run.read_start_config()
    if saved is None:
        return
    fix = f"set train.run_dir to a new directory, or remove {run} if you no longer need that run"
    if not isinstance(saved, dict):
        return
    if (saved.get("checkpoint") or {}).get("enabled") is False:
        raise ConfigError(
            f"--resume: {run} holds a run that saved no checkpoints (checkpoint.enabled=false), so "
            f"there is nothing to resume, and starting over would write over it; {fix}"
        )
    old = json.loads(json.dumps(saved.get("model") or {}))
    new = json.loads(json.dumps(to_dict(cfg.model)))
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if diff:
        was = ", ".join(f"model.{k}={old.get(k)} there, {new.get(k)} here" for k in diff[:3])
        raise ConfigError(
            f"--resume: {run} holds a run of another model ({was}) and no checkpoint, so starting "
            f"over would write over it; {fix}"
        )
