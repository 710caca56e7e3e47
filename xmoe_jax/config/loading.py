"""Configs in and out: plain data (YAML, JSON, a checkpoint's saved config) to the dataclasses and
back, dotted `--set` overrides, and the migration of older layouts. Unknown keys and wrong types
are errors naming the key, never ignored; an unknown key also names the key it most likely meant
and where it was written (the file's line and column, or the `--set` that gave it)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib
import typing
from typing import Any, Literal

from xmoe_jax.config import yaml_io
from xmoe_jax.config.applies import check_switches
from xmoe_jax.config.checks import _resolve_type
from xmoe_jax.config.choices import removed
from xmoe_jax.config.run import Config
from xmoe_jax.errors import ConfigError

# keys that describe placement, not the model: moved from model(.moe) to `parallel`
MOVED_TO_PARALLEL = {
    "model.moe.dispatch": "parallel.dispatch",
    "model.moe.transport": "parallel.transport",
    "model.moe.recv_buffer_factor": "parallel.recv_buffer_factor",
    "model.moe.ssmb": "parallel.ssmb",
    "model.moe.expert_tensor_parallel": "parallel.expert_tensor_parallel",
    "model.moe.auto_shard": "parallel.auto_shard",
    "model.sequence_parallel": "parallel.sequence_parallel",
}


class UnknownKeyError(ConfigError):
    """A config key that no config section has; `key` is its dotted name, so that `load_config` can
    say where it was written."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _unknown_key(prefix: str, key: str, names: set[str]) -> UnknownKeyError:
    """The error for `prefix + key`, with the closest valid key (difflib) when one is close."""
    close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
    section = f"valid keys under '{prefix.rstrip('.') or '<top>'}'"
    fix = (
        f"did you mean {prefix}{close[0]}? ({section}: {sorted(names)})"
        if close
        else f"{section} are {sorted(names)}"
    )
    return UnknownKeyError(f"{prefix}{key}", f"unknown config key {prefix}{key}; {fix}")


def _coerce(path: str, tp: Any, value: Any) -> Any:
    base, optional = _resolve_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path} may not be null")
    if dataclasses.is_dataclass(base):
        if isinstance(value, base):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {type(value).__name__}")
        return _build(base, value, path + ".")
    if typing.get_origin(base) is tuple:
        return _coerce_tuple(path, base, value)
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value not in choices:
            raise ConfigError(removed(base, value, path) or f"{path}={value!r} is not one of {list(choices)}")
        return value
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(f"{path} must be {base.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _coerce_tuple(path: str, tp: Any, value: Any) -> tuple:
    """`tuple[X, ...]` (any length) or `tuple[X, Y]` (fixed) from a YAML list."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path} must be a list, got {value!r} ({type(value).__name__})")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        types_ = [args[0]] * len(value)
    else:
        if len(value) != len(args):
            raise ConfigError(f"{path} must have {len(args)} entries, got {len(value)}")
        types_ = list(args)
    return tuple(_coerce(f"{path}[{i}]", t, v) for i, (t, v) in enumerate(zip(types_, value, strict=True)))


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for key in unknown:
        moved = MOVED_TO_PARALLEL.get(prefix + key)
        if moved is not None:
            raise ConfigError(
                f"{prefix}{key} moved to {moved} (it says how the model is placed, not what it is); "
                f"write {moved}={data[key]} (a top-level '{moved.split('.')[0]}:' section in YAML) instead"
            )
    if unknown:
        raise _unknown_key(prefix, unknown[0], names)
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def from_dict(data: dict, cls: type = Config) -> Any:
    """Builds a (nested) config dataclass from plain data, validating keys and types. A whole
    `Config` is a run as written (YAML, `--set`, a run's config.yaml), so its switches must also
    apply (config/applies.py); `resolve.resolve_placement` later fills in facts such as a concrete
    transport, which `dataclasses.replace` does not check again."""
    cfg = _build(cls, data or {})
    if isinstance(cfg, Config):
        check_switches(cfg)
    return cfg


def migrate_dict(data: dict) -> dict:
    """A config dict as older versions wrote it (checkpoints) in today's layout: placement keys
    that lived under model(.moe) move to `parallel`. Returns a new dict; `data` is untouched."""
    out = json.loads(json.dumps(data))
    for old, new in MOVED_TO_PARALLEL.items():
        *parents, leaf = old.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            value = node.pop(leaf)
            section, key = new.split(".")
            out.setdefault(section, {}).setdefault(key, value)
    return out


def _plain(value: Any) -> Any:
    """Lists for tuples, recursively: what JSON and YAML read back."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def to_dict(cfg: Any) -> dict:
    """Plain data (dicts, lists, scalars) that `from_dict` turns back into `cfg`."""
    return _plain(dataclasses.asdict(cfg))


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """`key=value` strings -> (dotted key, YAML-parsed value)."""
    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml_io.parse_value(key.strip(), raw)))
    return out


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] | None = None) -> Config:
    """Reads `path` (YAML; None = built-in defaults) and applies dotted overrides."""
    data: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass --config configs/<name>.yaml")
        data = yaml_io.load_file(p) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    try:
        return from_dict(override_dict(data, overrides))
    except UnknownKeyError as e:
        raise ConfigError(f"{_written_at(e.key, path, overrides)}: {e}") from None


def _written_at(key: str, path: str | pathlib.Path | None, overrides: list[str] | None) -> str:
    """Where the unknown dotted `key` came from: the last `--set` that gives it (or a key under it),
    else `config file PATH:LINE:COLUMN`."""
    for item in reversed(overrides or []):
        given = item.split("=", 1)[0].strip()
        if given == key or given.startswith(key + "."):
            return f"--set {item}"
    at = yaml_io.key_position(path, key.split(".")) if path is not None else None
    return f"config file {path}:{at[0]}:{at[1]}" if at else f"config file {path}"


def override_dict(data: dict, overrides: list[str] | None) -> dict:
    """`data` (a config as plain data) with dotted `key=value` overrides applied, in place."""
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    return data
