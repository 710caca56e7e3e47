"""YAML in: a config file or a `--set` value, read strictly, every error one line with where.

`load_file(path)` and `parse_value(key, text)` raise `ConfigError`:
  - a syntax error (an unclosed bracket, a tab in the indentation) names the file, line and
    column (1-based, as editors count) and what YAML expected;
  - a file that is not UTF-8 names the byte offset and line of the first bad byte;
  - a key given twice in one mapping (`train:` twice) is refused naming the key and both lines
    (PyYAML keeps the last silently, dropping the first section).
`key_position(path, keys)` says where a key was written, for errors found after loading (an
unknown key: `loading.py`).
"""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from xmoe_jax.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key '{key}' appears twice in one mapping (first on line {first.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _where(e: yaml.YAMLError) -> tuple[str, yaml.Mark | None]:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    text = f"{problem} ({context})" if context and context not in problem else problem
    if "'\\t'" in text:
        text += "; YAML indents with spaces, not tabs"
    return text, mark


def _load(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def load_file(path: str | pathlib.Path) -> Any:
    """The YAML document in `path`; `ConfigError` naming the file, line and column on any error."""
    p = pathlib.Path(path)
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {p}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None
    try:
        return _load(text)
    except yaml.YAMLError as e:
        problem, mark = _where(e)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {p}{at}: {problem}; fix the YAML there") from None


def parse_value(key: str, text: str) -> Any:
    """The YAML value of `--set key=text`; `ConfigError` naming the override and the column."""
    try:
        return _load(text)
    except yaml.YAMLError as e:
        problem, mark = _where(e)
        at = f" at column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"--set {key}={text}: not a valid YAML value{at}: {problem}; close brackets and quotes, "
            f"or quote the whole value as a string (--set '{key}=\"...\"')"
        ) from None


def key_position(path: str | pathlib.Path, keys: list[str]) -> tuple[int, int] | None:
    """(line, column), 1-based, of the nested key `keys` (["train", "stpes"]) in the YAML file
    `path`; None if it is not written there. Reads the file again: only an error asks."""
    try:
        node = yaml.compose(pathlib.Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    mark = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            return None
        found = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key]
        if not found:
            return None
        mark, node = found[-1][0].start_mark, found[-1][1]
    return (mark.line + 1, mark.column + 1) if mark is not None else None
