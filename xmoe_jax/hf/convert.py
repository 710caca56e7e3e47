"""Import and export: a HuggingFace directory <-> a run directory, through an adapter.

Import (`import_checkpoint`):
  1. read config.json, pick the adapter by `model_type`, make our Config (the adapter refuses
     what we do not implement) and apply the user's dotted overrides (mesh, train, data, ...);
  2. check the tensors: every one the model needs is there, none is left over (and, as each is
     read, that it holds no NaN or infinity, unless `allow_nonfinite`);
  3. build each parameter on the mesh from the tensors each device's shard covers;
  4. write the run: config.yaml, a step-0 checkpoint (fresh optimizer state), the source
     config.json as hf_config.json (export starts from it: token ids and the like survive) and
     the directory's tokenizer, if it has one, as the run's (`<run_dir>/tokenizer/`).
Export (`export_checkpoint`):
  1. read the run's config at `step`, pick the adapter (`arch`, else the first that can
     represent the model, else an error with each adapter's reason);
  2. restore the weights onto the run's mesh (or one given by overrides);
  3. write the tensors in HF names (per-expert layout, as `save_pretrained` writes) a layer at
     a time into (sharded) safetensors, config.json and the run's tokenizer (`tokenizer.py`),
     all into a temporary sibling of the output folder that replaces it at the end (`export_dir.py`:
     what an existing folder may hold, what of it survives, one export per folder at a time).
Both check their paths before anything loads and report their stages through `report`; import
reads config.json through `config_json.py`, which names the file and the field of a bad value.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax

from xmoe_jax import sharding
from xmoe_jax.config import Config, from_dict, override_dict, to_dict
from xmoe_jax.data import provenance
from xmoe_jax.errors import XmoeError
from xmoe_jax.hf import ADAPTERS, Adapter, config_json, export_dir
from xmoe_jax.hf.adapter import IGNORED_TENSORS
from xmoe_jax.hf.mapping import (
    ConversionError,
    check_keys,
    export_tensors,
    flat_leaves,
    layer_offsets,
    load_leaf,
    nest,
)
from xmoe_jax.hf.safetensors_io import DEFAULT_SHARD_BYTES, Reader, write_sharded
from xmoe_jax.hf.tokenizer import export_tokenizer
from xmoe_jax.model import functional as fmodel
from xmoe_jax.train.rundir import RunDir
from xmoe_jax.train.weights import load_weights, save_initial


def read_hf_config(hf_dir: str | Path) -> dict:
    """`<hf_dir>/config.json`, its fields checked (`config_json.py`)."""
    return config_json.read(hf_dir)


def adapter_for(model_type: str | None) -> Adapter:
    if model_type not in ADAPTERS:
        raise ConversionError(
            f"model_type {model_type!r} has no adapter; supported: {sorted(ADAPTERS)} (xmoe_jax/hf/)"
        )
    return ADAPTERS[model_type]


def choose_adapter(cfg: Config, arch: str | None = None) -> Adapter:
    """`arch`'s adapter if it can represent the model, else the first that can."""
    candidates = [adapter_for(arch)] if arch else list(ADAPTERS.values())
    reasons = {a.model_type: a.unsupported(cfg.model) for a in candidates}
    for a in candidates:
        if reasons[a.model_type] is None:
            return a
    if arch:
        raise ConversionError(f"--arch {arch} cannot hold this model: {reasons[arch]}")
    nearest = sorted(reasons, key=lambda name: reasons[name].count(";"))[:2]
    detail = " ".join(f"{name}: {reasons[name]}." for name in nearest)
    raise ConversionError(
        f"no HuggingFace architecture holds this model; the nearest, and what it lacks: {detail} Train a config that exports "
        "(configs/tiny_hf.yaml: Qwen2-MoE-shaped), or pass --arch NAME for that architecture's reasons"
    )


def import_config(
    hf: dict,
    out_dir: str | Path,
    overrides: list[str] | None = None,
    tensor_keys: set[str] | None = None,
    source: str = "config.json",
) -> Config:
    """Our Config for a HuggingFace config.json (`source` names it in errors): its model, defaults
    elsewhere, run_dir = out_dir; `tensor_keys` (the checkpoint's tensor names) settle what
    config.json cannot (MTP modules)."""
    hf = config_json.check(hf, source)
    adapter = adapter_for(hf["model_type"])
    try:
        model = adapter.to_model_config(hf)
        if tensor_keys is not None:
            model = adapter.with_tensors(model, hf, tensor_keys)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
        if isinstance(e, XmoeError):
            raise
        # config_json.check knows the fields the adapters read; a value it lets through still names the file
        raise ConversionError(
            f"{source}: a field has a value {adapter.model_type} cannot take ({type(e).__name__}: {e}); "
            "compare it with the model's published config.json"
        ) from None
    data = to_dict(Config(model=model))
    data["train"]["run_dir"] = str(out_dir)
    return from_dict(override_dict(data, overrides))


def _targets(spec: fmodel.ModelSpec, mesh, fsdp: bool) -> dict[str, jax.ShapeDtypeStruct]:
    params_sh, bias_sh = fmodel.shardings(spec, mesh, fsdp)
    out = {}
    for name, shapes, shards in (
        ("params", spec.params_shape, params_sh),
        ("bias", spec.bias_shape, bias_sh),
    ):
        flat_sh = flat_leaves(shards, name)
        for path, x in flat_leaves(shapes, name).items():
            out[path] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=flat_sh[path])
    return out


def _rules_for(adapter: Adapter, cfg: Config, targets: dict) -> list:
    rules = adapter.rules(cfg.model)
    uncovered = sorted(set(targets) - {r.ours for r in rules})
    unknown = sorted({r.ours for r in rules} - set(targets))
    if uncovered or unknown:  # an adapter bug, or an override that changed the parameters
        raise ConversionError(
            f"{adapter.model_type}: parameters {uncovered} have no tensor and rules {unknown} no parameter; "
            "do not override model.* keys that change the parameters"
        )
    return rules


def load_hf_weights(
    hf_dir: str | Path, cfg: Config, mesh, allow_nonfinite: bool = False
) -> tuple[dict, dict]:
    """(params, bias) of a HuggingFace directory, each leaf placed on `mesh` as cfg says; a NaN or
    infinite weight is refused naming its tensor unless `allow_nonfinite`."""
    adapter = adapter_for(read_hf_config(hf_dir).get("model_type"))
    targets = _targets(fmodel.model_spec(cfg.model, cfg.parallel), mesh, cfg.mesh.fsdp)
    rules = _rules_for(adapter, cfg, targets)
    reader = Reader(hf_dir, check_finite=not allow_nonfinite)
    ignored = IGNORED_TENSORS + adapter.ignored_tensors
    ignored += ("lm_head.weight",) if cfg.model.tie_embeddings else ()
    offsets = layer_offsets(cfg.model.num_dense_layers, cfg.model.num_layers)
    check_keys(reader, rules, targets, offsets, ignored)
    leaves = {r.ours: load_leaf(reader, r, targets[r.ours], offsets) for r in rules}
    return nest(leaves, "params"), nest(leaves, "bias")


def _no_report(line: str) -> None:
    """Progress lines go nowhere unless the caller gives `report` (the CLI prints them to stderr)."""


def import_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    overrides: list[str] | None = None,
    report: Callable[[str], None] = _no_report,
    *,
    allow_nonfinite: bool = False,
) -> Config:
    """Steps 1-4 of the module docstring; returns the Config written to out_dir/config.yaml. A new
    `out_dir` is removed again if the import stops half way (an error, Ctrl-C). A NaN or infinite
    weight stops it, naming the tensor, unless `allow_nonfinite`."""
    out = export_dir.out_folder(out_dir, "the new run")
    if RunDir(out).holds_run():  # before anything loads
        raise ConversionError(f"--out {out_dir} already holds a run; choose a new run directory")
    hf = read_hf_config(hf_dir)
    cfg = import_config(hf, out_dir, overrides, Reader(hf_dir).keys(), hf.source)
    has_tokenizer = any((Path(hf_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    if has_tokenizer and cfg.data.tokenizer == provenance.AUTO:  # the run's tokenizer: its copy
        tokenizer = str(RunDir(out_dir).tokenizer)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    cfg.validate_for_devices(jax.device_count(), jax.process_count())
    mesh = sharding.make_mesh(cfg.mesh)
    created = not out.exists()
    try:
        with jax.set_mesh(mesh):
            report(f"reading the tensors of {hf_dir} onto {mesh.size} device(s)")
            weights = load_hf_weights(hf_dir, cfg, mesh, allow_nonfinite)
            report(f"writing step 0 of the run {out_dir}")
            save_initial(cfg, weights, mesh)
        shutil.copyfile(Path(hf_dir) / "config.json", RunDir(out_dir).hf_source_config)
        if has_tokenizer:
            provenance.copy_tokenizer(str(hf_dir), RunDir(out_dir).tokenizer)
    except BaseException:
        if created:  # no half-written run to refuse the next try
            shutil.rmtree(out, ignore_errors=True)
        raise
    return cfg


def next_steps(hf_dir: str | Path, cfg: Config) -> str:
    """What to do with an imported pretrained model: generate from it, or fine-tune it on real data
    (left as it is, the run's data is synthetic numbers: training on it would only unlearn)."""
    run = cfg.train.run_dir
    text = cfg.data.tokenizer not in ("auto", "bytes")  # the model's own tokenizer came along
    prompt = '--prompt "Hello"' if text else "--prompt-ids '1 2 3'"
    lines = [
        f"imported {hf_dir} into {run}: step 0 holds its weights (a fresh optimizer state). Next:",
        f"  generate:  xmoe-generate --run-dir {run} {prompt} --max-tokens 32",
    ]
    if cfg.data.path is not None or cfg.data.mixture:  # given at import: the run trains on it
        data = f"data.path={cfg.data.path}" if cfg.data.path is not None else "data.mixture"
        lines.append(f"  fine-tune: xmoe-train --config {run}/config.yaml --resume   # on its {data}")
        return "\n".join(lines)
    tokenizer = cfg.data.tokenizer if text else "TOKENIZER.json"
    lines += [
        f"  fine-tune: xmoe-tokenize --input 'corpus/*.jsonl' --tokenizer {tokenizer} --output data/corpus",
        f"             xmoe-train --config {run}/config.yaml --resume --set data.path=data/corpus",
        "  (its data is synthetic numbers until data.path is set: training on those only unlearns)",
    ]
    return "\n".join(lines)


def hf_config(cfg: Config, adapter: Adapter, run_dir: str | Path, dtype: str) -> dict:
    """config.json: the imported source's (same architecture) updated with the model's fields."""
    source = RunDir(run_dir).hf_source_config
    base = json.loads(source.read_text()) if source.is_file() else {}
    if base.get("model_type") != adapter.model_type:
        base = {}
    base.pop("torch_dtype", None)
    return {**base, **adapter.to_hf_config(cfg.model), "dtype": dtype}


def export_checkpoint(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    arch: str | None = None,
    dtype: str = "float32",
    overrides: list[str] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    *,
    overwrite: bool = False,
    replace_tokenizer: bool = False,
    report: Callable[[str], None] = _no_report,
) -> list[str]:
    """Steps 1-3 of the module docstring, into `out_dir` as `export_dir.py` allows (`overwrite` an
    earlier export; `replace_tokenizer` one the folder had); returns the names of the files written
    besides config.json (safetensors, index, tokenizer). `report` gets a line per stage."""
    if dtype not in ("float32", "bfloat16"):
        raise ConversionError(f"--dtype {dtype!r}: choose float32 (exact) or bfloat16")
    with export_dir.held(out_dir, report):  # one export per folder, from the plan to the swap
        target = export_dir.plan(out_dir, overwrite, replace_tokenizer)  # before anything loads
        return _export(target, run_dir, step, arch, dtype, overrides, max_shard_bytes, report)


def _export(
    target: export_dir.Target,
    run_dir: str | Path,
    step: int | None,
    arch: str | None,
    dtype: str,
    overrides: list[str] | None,
    max_shard_bytes: int,
    report: Callable[[str], None],
) -> list[str]:
    import ml_dtypes

    cfg, step = RunDir(run_dir).config_at(step, overrides)  # the config that step was written under
    adapter = choose_adapter(cfg, arch)
    cfg.validate_for_devices(jax.device_count(), jax.process_count())
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        report(f"restoring step {step} of {run_dir} onto {mesh.size} device(s)")
        params, bias = load_weights(run_dir, cfg, step, mesh)
        leaves = {**flat_leaves(params, "params"), **flat_leaves(bias, "bias")}
        rules = _rules_for(adapter, cfg, leaves)
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else None
        offsets = layer_offsets(cfg.model.num_dense_layers, cfg.model.num_layers)
        tensors = export_tensors(rules, leaves, offsets, np_dtype)
        with export_dir.staged(target) as tmp:
            report(f"writing {adapter.model_type} tensors in {dtype} beside {target.out}")
            files = write_sharded(tensors, tmp, max_shard_bytes, report)
            config = hf_config(cfg, adapter, run_dir, dtype)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            if target.keep_tokenizer:
                report(
                    f"kept the tokenizer {target.out} had ({', '.join(target.tokenizer_kept)}); "
                    "--replace-tokenizer writes the run's instead"
                )
            else:
                files += export_tokenizer(RunDir(run_dir).tokenizer, cfg.data.tokenizer, tmp)
            report(f"moving the export into place: {target.out}")
    return files
