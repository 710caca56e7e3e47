"""Which tokenizer a dataset and a run were made with: resolved, checked and copied.

Why: token ids mean nothing without the tokenizer that made them, and a model trained on one
tokenizer's ids and read with another's produces garbage without any error. So the tokenizer
travels with the ids:
  1. `xmoe-tokenize` copies the tokenizer into its output (`<output>/tokenizer/`) and records
     its fingerprint (`tokenizer_sha256`) in manifest.json;
  2. the trainer resolves `data.tokenizer: auto` (the default) to the tokenizer of its
     pre-tokenized data (else `bytes`), and refuses an explicit `data.tokenizer` that differs
     from the one the data was made with, before anything compiles;
  3. the run keeps a copy (`<run_dir>/tokenizer/`, beside config.yaml), which `xmoe-eval`,
     `xmoe-generate` and `xmoe-convert export` use unless `--set data.tokenizer=...` says otherwise.

A fingerprint is the sha256 of the files that define the tokenizer (`tokenizer_files`: the
tokenizer.json or sentencepiece model, and the tokenizer_config.json naming its eos token), so the
same tokenizer matches wherever it is copied; `bytes` is its own fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil

from xmoe_jax import storage
from xmoe_jax.config import Config, ConfigError, SourceConfig
from xmoe_jax.data import sources
from xmoe_jax.data.arrayrecord import read_manifest
from xmoe_jax.data.tokenizer import load_tokenizer

AUTO = "auto"
BYTES = "bytes"
COPY_DIR = "tokenizer"  # under an xmoe-tokenize output (a run's copy: RunDir.tokenizer)


def tokenizer_files(name: str) -> dict[str, pathlib.Path]:
    """The files that define tokenizer `name`, by the name its copy gives them ({} for bytes)."""
    if name in (BYTES, AUTO):
        return {}
    path = pathlib.Path(name)
    if path.is_file():
        core = {".json": "tokenizer.json", ".model": "tokenizer.model"}.get(path.suffix, path.name)
        files, directory = {core: path}, path.parent
    elif (path / "tokenizer.json").is_file():
        files, directory = {"tokenizer.json": path / "tokenizer.json"}, path
    elif any((path / m).is_file() for m in ("tokenizer.model", "spiece.model")):
        model = next(path / m for m in ("tokenizer.model", "spiece.model") if (path / m).is_file())
        files, directory = {"tokenizer.model": model}, path
    elif path.is_dir():  # a transformers directory: everything at its top level
        return {p.name: p for p in sorted(path.iterdir()) if p.is_file()}
    else:
        load_tokenizer(name)  # raises the error that names the field and the fix
        return {}
    if (directory / "tokenizer_config.json").is_file():
        files["tokenizer_config.json"] = directory / "tokenizer_config.json"
    return files


def fingerprint(name: str) -> str:
    """`bytes`, or the sha256 of the tokenizer's files (names and contents)."""
    if name in (BYTES, AUTO):
        return BYTES
    digest = hashlib.sha256()
    for key, path in sorted(tokenizer_files(name).items()):
        digest.update(key.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def copy_tokenizer(name: str, dest: pathlib.Path) -> None:
    """Copies the tokenizer's files into `dest` (a directory `load_tokenizer` reads); nothing for
    bytes. A new `dest` appears whole or not at all (copied into a temporary folder beside it, then
    renamed): a failed copy (a full disk) must not leave half a tokenizer that the next run takes
    for the data's (`storage.WriteError` naming `dest`). An existing `dest` (an export's folder)
    gets the files one by one."""
    files = tokenizer_files(name)
    if not files:
        return
    if dest.is_dir():  # a folder that holds other files too (an export): file by file
        for key, path in files.items():
            shutil.copyfile(path, dest / key)
        return
    tmp = dest.with_name(f".{dest.name}.partial")
    try:
        with storage.writing(dest):
            shutil.rmtree(tmp, ignore_errors=True)  # a killed copy's
            tmp.mkdir(parents=True)
            for key, path in files.items():
                shutil.copyfile(path, tmp / key)
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _Made:
    """The tokenizer one pre-tokenized source was made with."""

    where: str  # `data.path='data/corpus'`
    name: str | None  # a tokenizer that load_tokenizer reads, or None if it is gone
    recorded: str  # what the manifest says (`tokenizer`)
    sha: str | None  # fingerprint, if the manifest or the tokenizer gives it
    vocab_size: int
    eos_id: int


def _made_with(src: SourceConfig, prefix: str) -> _Made | None:
    """For xmoe-tokenize output: the tokenizer its manifest names; None for other kinds."""
    if sources.detect_kind(src, prefix) != "arrayrecord":
        return None
    root = pathlib.Path(src.path)
    manifest = read_manifest(root) or {}
    recorded = str(manifest.get("tokenizer", BYTES))
    if recorded == BYTES:
        name = BYTES
    elif (root / COPY_DIR).is_dir():
        name = str(root / COPY_DIR)
        _check_copy(root / COPY_DIR, manifest.get("tokenizer_sha256"), f"{prefix}path={src.path!r}", recorded)
    else:  # written before copies: the name as xmoe-tokenize was given it
        name = recorded if pathlib.Path(recorded).exists() else None
    sha = manifest.get("tokenizer_sha256") or (fingerprint(name) if name else None)
    vocab, eos = int(manifest.get("vocab_size", 0)), int(manifest.get("eos_id", -1))
    return _Made(f"{prefix}path={src.path!r}", name, recorded, sha, vocab, eos)


def _check_copy(copy: pathlib.Path, sha: str | None, where: str, recorded: str) -> None:
    """The tokenizer xmoe-tokenize copied beside the shards, checked where it is first read: it
    loads, and its files are those the manifest's fingerprint names. Why here: a damaged copy would
    go into the run without a word, and the tools would then blame a data.tokenizer nobody set.
    `ConfigError` naming the file and the fix."""
    fix = (
        f"copy the tokenizer the data was made with ({recorded}) into {copy}, or run the xmoe-tokenize "
        "command again into a new --output"
    )
    _check_loads(copy, f"the copy of the tokenizer {where} was made with", fix)
    if sha is not None and fingerprint(str(copy)) != sha:
        files = ", ".join(str(p) for p in tokenizer_files(str(copy)).values())
        raise ConfigError(
            f"{copy} ({files}), the copy of the tokenizer {where} was made with, differs from the one "
            f"its manifest.json records (tokenizer_sha256): it was edited or damaged; {fix}"
        )


def _check_loads(copy: pathlib.Path, what: str, fix: str) -> None:
    """`ConfigError` naming the file of the tokenizer in `copy` that cannot be read (the loader's
    own error speaks of a data.tokenizer setting, which the user did not make)."""
    try:
        load_tokenizer(str(copy))
    except ConfigError as e:
        detail = (
            str(e)
            .replace(f"data.tokenizer={str(copy)!r}: ", "")
            .replace(f"data.tokenizer={str(copy)!r}", str(copy))
        )
        raise ConfigError(f"{detail} ({copy} is {what}); {fix}") from None


def _differs(explicit: str, made: _Made) -> bool:
    if made.sha is not None:
        return fingerprint(explicit) != made.sha
    tok = load_tokenizer(explicit)
    return (tok.vocab_size, tok.eos_id) != (made.vocab_size, made.eos_id)


def _sources(cfg: Config, eval_only: bool) -> list[tuple[SourceConfig, str]]:
    if cfg.eval.data is not None and eval_only:
        return [(cfg.eval.data, "eval.data.")]
    data = cfg.data
    out = [(data.sources[0], "data.")] if not data.mixture else []
    out += [(s, f"data.mixture[{k}].") for k, s in enumerate(data.mixture)]
    return out + ([(cfg.eval.data, "eval.data.")] if cfg.eval.data is not None else [])


def resolve(cfg: Config, *, strict: bool = True, eval_only: bool = False) -> Config:
    """`cfg` with `data.tokenizer` resolved (`auto` -> the pre-tokenized data's tokenizer, else
    `bytes`) and checked against every pre-tokenized source. `ConfigError` on a mismatch, on
    sources made with different tokenizers, or when the data's tokenizer is gone and none is
    named. `strict=False` (the tools, which need no training data) skips sources that are not there;
    `eval_only` checks only eval.data when it is set."""
    made: list[_Made] = []
    for src, prefix in _sources(cfg, eval_only):
        try:
            m = _made_with(src, prefix)
        except ConfigError:
            if strict:
                raise
            continue
        if m is not None:
            made.append(m)
    explicit = cfg.data.tokenizer
    if explicit != AUTO:
        for m in made:
            if _differs(explicit, m):
                raise ConfigError(
                    f"data.tokenizer={explicit!r} is not the tokenizer {m.where} was made with "
                    f"({m.recorded!r}); leave data.tokenizer unset (auto: the data's own) or tokenize the "
                    "data again with this tokenizer"
                )
        return cfg
    shas = {m.sha for m in made}
    if len(shas) > 1:
        raise ConfigError(
            f"{' and '.join(m.where for m in made)} were made with different tokenizers "
            f"({[m.recorded for m in made]}); tokenize them with one tokenizer"
        )
    if not made:
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=BYTES))
    first = made[0]
    if first.name is None:
        raise ConfigError(
            f"{first.where} was made with tokenizer {first.recorded!r}, which is not there; set "
            "data.tokenizer to that tokenizer (its tokenizer.json, .model or directory)"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=first.name))


def record(dest: pathlib.Path, name: str, *, write: bool = True) -> None:
    """Keeps the run's tokenizer in `dest` (`RunDir.tokenizer`; `write`: process 0 copies; every
    process checks). A resumed run keeps its copy and is refused if its tokenizer changed."""
    if dest.is_dir():
        if fingerprint(str(dest)) != fingerprint(name):
            raise ConfigError(
                f"{dest.parent} was trained with the tokenizer in {dest}, and data.tokenizer={name!r} differs; "
                "use that tokenizer or a new train.run_dir"
            )
        return
    if write:
        copy_tokenizer(name, dest)


def for_tools(copy: pathlib.Path, cfg: Config, overrides: list[str]) -> Config:
    """The run's config as `xmoe-eval` / `xmoe-generate` use it: `data.tokenizer` from an override,
    else the run's copy (`copy`: `RunDir.tokenizer`), else the run's config (resolved: runs written
    before copies)."""
    overridden = any(o.split("=", 1)[0].strip() == "data.tokenizer" for o in overrides)
    if not overridden and copy.is_dir():
        fix = (
            f"copy the tokenizer the run was trained with into {copy}, or name it with "
            "--set data.tokenizer=PATH"
        )
        _check_loads(copy, f"the copy of the tokenizer {copy.parent} was trained with", fix)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(copy)))
    return resolve(cfg, strict=False, eval_only=True)
