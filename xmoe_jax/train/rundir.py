"""A run on disk: every path of a run directory, and the config each of its steps ran under.

    <run_dir>/
      config.yaml              the config the run started with (a human's copy; see below)
      metrics.jsonl            one record per step (and eval records); `trim_metrics` on resume
      metrics.discarded.jsonl  records of steps a kill lost, moved aside
      checkpoints/<step>/      orbax steps, each with the config it was written under
      tokenizer/               the run's copy of its tokenizer (data/provenance.py)
      hf_config.json           an imported model's source config.json (hf/convert.py)
      tensorboard/ profile/ plots/
      run.lock                 one writer at a time (runlock.py)

Which config a step ran under: a resume may change the config (a longer schedule, another top_k),
so `config.yaml` describes the run's start only. Every checkpoint saves its own config, and the tools
(`xmoe-eval`, `xmoe-generate`, `xmoe-convert export`) read that one (`RunDir.config_at`); runs whose
checkpoints hold no config fall back to `config.yaml`.

Light on purpose (no JAX at import): `xmoe-plot` and the CLI's start-up read paths from here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import yaml

from xmoe_jax import storage
from xmoe_jax.config import Config, ConfigError, from_dict, load_config, migrate_dict, override_dict, to_dict

log = logging.getLogger("xmoe_jax")

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
DISCARDED_METRICS = "metrics.discarded.jsonl"
LOCK_NAME = "run.lock"
TOKENIZER_NAME = "tokenizer"
HF_SOURCE_NAME = "hf_config.json"


@dataclasses.dataclass(frozen=True)
class RunDir:
    root: Path  # a str is taken too

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    config = property(lambda self: self.root / CONFIG_NAME)
    metrics = property(lambda self: self.root / METRICS_NAME)
    discarded_metrics = property(lambda self: self.root / DISCARDED_METRICS)
    checkpoints = property(lambda self: self.root / "checkpoints")
    tokenizer = property(lambda self: self.root / TOKENIZER_NAME)
    tensorboard = property(lambda self: self.root / "tensorboard")
    profile = property(lambda self: self.root / "profile")
    plots = property(lambda self: self.root / "plots")
    lock = property(lambda self: self.root / LOCK_NAME)
    hf_source_config = property(lambda self: self.root / HF_SOURCE_NAME)

    def __str__(self) -> str:
        return str(self.root)

    # -- the config

    def write_config(self, cfg: Config) -> None:
        """Whole or not at all (`storage.WriteError` naming it on a full disk)."""
        with storage.replacing(self.config) as tmp:
            tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def read_start_config(self):
        """config.yaml as written at the start (any YAML value; {} if unreadable), None if absent."""
        if not self.config.is_file():
            return None
        try:
            return yaml.safe_load(self.config.read_text()) or {}
        except (OSError, ValueError, yaml.YAMLError):
            return {}

    def holds_run(self) -> bool:
        return self.checkpoints.exists() or self.config.exists()

    def checkpointer(self, cfg: Config | None = None):
        """The run's `Checkpointer` for reading (a `CheckpointError` if it saved none)."""
        from xmoe_jax.train.checkpoint import Checkpointer, CheckpointError  # orbax: only when read

        if not self.checkpoints.is_dir():
            raise CheckpointError(
                f"{self.root} has no checkpoints/ directory; pass the train.run_dir of a run that saved "
                "checkpoints (checkpoint.enabled=true)"
            )
        return Checkpointer(self.checkpoints, (cfg or Config()).checkpoint)

    def config_at(self, step: int | None = None, overrides: list[str] | None = None) -> tuple[Config, int]:
        """(the Config checkpoint `step` (latest if None) was written under, with dotted `overrides`
        applied and train.run_dir set to this directory; the step). A checkpoint without a saved
        config (written with config=None) falls back to config.yaml."""
        with self.checkpointer() as ckpt:
            step = ckpt.resolve_step(step)  # a `CheckpointError` naming the steps there are
            saved = ckpt.saved_config(step)
        run_dir = [f"train.run_dir={self.root}"]
        if saved is None:
            if not self.config.is_file():
                raise ConfigError(
                    f"checkpoint step {step} in {self.checkpoints} saved no config and {self.config} is "
                    "missing; pass the run directory xmoe-train wrote (--run-dir)"
                )
            return load_config(self.config, [*(overrides or []), *run_dir]), step
        return from_dict(override_dict(migrate_dict(saved), [*(overrides or []), *run_dir])), step

    def input_config(self, step: int | None = None, overrides: list[str] | None = None) -> Config:
        """The config a tool checks its input with (prompts, tokenizer) before it reads weights:
        `config_at(step)` when the run has checkpoints, else config.yaml (defaults without one),
        so a bad flag is named first and a missing checkpoint after."""
        if self.checkpoints.is_dir():
            return self.config_at(step, overrides)[0]
        return load_config(self.config if self.config.is_file() else None, overrides)

    # -- metrics

    def trim_metrics(self, step: int) -> None:
        """Moves the records of metrics.jsonl after `step` (and a torn last line) aside: on resume,
        steps a hard kill lost run again, so metrics.jsonl keeps one record per step."""
        path = self.metrics
        if not path.exists():
            return
        keep, drop = [], []
        for line in path.read_text().splitlines(keepends=True):
            try:
                after = not line.endswith("\n") or json.loads(line)["step"] > step
            except (ValueError, KeyError, TypeError):
                after = True
            (drop if after else keep).append(line)
        if not drop:
            return
        with self.discarded_metrics.open("a") as f:
            f.writelines(x if x.endswith("\n") else x + "\n" for x in drop)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
        log.warning(
            "metrics.jsonl: %d record(s) after step %d (steps lost when the run was stopped; they run "
            "again) moved to %s",
            len(drop),
            step,
            self.discarded_metrics,
        )
