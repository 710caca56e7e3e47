"""Batched generation with a KV cache, compiled once per (rows, prompt length, new tokens).

Shapes: B rows, P prompt slots (the longest prompt), N new tokens, V vocab, S = P + N cache
slots (static). Steps, all inside one jit:
  1. left-pad the prompts to P (row b's first real slot is first_B[b]; positions count from
     there, so each row is computed as if alone: model/kv_cache.py); on a mesh, add dummy rows
     up to a multiple of the batch shards;
  2. prefill: the whole [B,P] prompt through `model.decode` once, filling slots 0..P-1, and
     sample the first new token from the last position's logits;
  3. decode: N-1 steps of one token per row (`lax.fori_loop`), each writing its slot and
     sampling the next token with key fold_in(seed key, step);
  4. back on the host, cut each row at its first `eos_id` (if given).

The MoE layers run through the same `moe_layer` as in training, with the run's placement
(`generation_config`): dropless (a capacity would let rows of the batch change each other's
output), no sequence parallelism or SSMB (one token per row per step), worst-case pft receive
buffers. On one device, `dense` dispatch is the simple choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from xmoe_jax import sharding
from xmoe_jax.config import Config, ConfigError
from xmoe_jax.generate.sampling import SamplingConfig, sample
from xmoe_jax.model import functional as fmodel
from xmoe_jax.model.kv_cache import init_cache
from xmoe_jax.resolve import exchange_devices, one_device_overrides, resolve_placement
from xmoe_jax.train.rundir import RunDir
from xmoe_jax.train.weights import load_weights

GREEDY = SamplingConfig(temperature=0.0)


def generation_config(cfg: Config) -> Config:
    """The run's config as generation runs it (see the module docstring)."""
    model = cfg.model
    if model.moe is not None:
        model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, capacity_factor=None))
    parallel = dataclasses.replace(cfg.parallel, ssmb=False, sequence_parallel=False, recv_buffer_factor=None)
    return dataclasses.replace(cfg, model=model, parallel=parallel)


def _rows_multiple(mesh: Mesh | None) -> int:
    return sharding.axis_size(mesh, ("data", *sharding.EXPERT_AXES))


@functools.lru_cache(maxsize=8)
def _compiled(cfg, parallel, num_new: int, sampling: SamplingConfig, mesh: Mesh | None):
    """The jitted generation for a model, placement and sampling (compiled once per prompt shape)."""
    spec = fmodel.model_spec(cfg, parallel)
    constrain = sharding.constrainer(mesh) if mesh is not None else None

    def run(params, bias, tokens_BP, first_B, key):
        num_rows, prompt_len = tokens_BP.shape
        cache = init_cache(spec.cfg, num_rows, prompt_len + num_new, first_B, constrain)
        logits_BV, cache = fmodel.decode(spec, params, bias, tokens_BP, cache)
        tok_B = sample(logits_BV, jax.random.fold_in(key, 0), sampling)
        out_BN = jnp.zeros((num_rows, num_new), jnp.int32).at[:, 0].set(tok_B)

        def step(i, carry):
            tok_B, cache, out_BN = carry
            logits_BV, cache = fmodel.decode(spec, params, bias, tok_B[:, None], cache)
            tok_B = sample(logits_BV, jax.random.fold_in(key, i), sampling)
            return tok_B, cache, out_BN.at[:, i].set(tok_B)

        return jax.lax.fori_loop(1, num_new, step, (tok_B, cache, out_BN))[2]

    return jax.jit(run)


def generate(
    spec: fmodel.ModelSpec,
    params: dict,
    bias: dict,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    *,
    mesh: Mesh | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    report: Callable[[str], None] | None = None,
) -> list[list[int]]:
    """New token ids per prompt (steps 1-4 of the module docstring); `mesh`: where params live;
    `report` gets a line before compiling and before generating."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-tokens={max_new_tokens} must be >= 1")
    prompt_len = max(len(p) for p in prompts)
    if prompt_len + max_new_tokens > spec.cfg.max_seq_len:
        raise ConfigError(
            f"prompt ({prompt_len}) + max tokens ({max_new_tokens}) > model.max_seq_len={spec.cfg.max_seq_len}"
        )
    vocab = spec.cfg.vocab_size
    if any(not 0 <= t < vocab for p in prompts for t in p):
        raise ConfigError(f"a prompt token is outside the model's vocabulary (0..{vocab - 1})")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ConfigError(
            f"--eos-id={eos_id} is outside the model's vocabulary (0..{vocab - 1}); no token could end a row"
        )
    multiple = _rows_multiple(mesh)
    num_rows = -(-len(prompts) // multiple) * multiple
    rows = [list(p) for p in prompts] + [[pad_id]] * (num_rows - len(prompts))
    tokens_BP = np.full((num_rows, prompt_len), pad_id, np.int32)
    first_B = np.asarray([prompt_len - len(r) for r in rows], np.int32)
    for b, row in enumerate(rows):
        tokens_BP[b, first_B[b] :] = row
    run = _compiled(spec.cfg, spec.parallel, max_new_tokens, sampling, mesh)
    report = report or (lambda line: None)
    args = (params, bias, tokens_BP, first_B, jax.random.key(seed))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        report(f"compiling generation: {num_rows} row(s), {prompt_len} prompt + {max_new_tokens} new tokens")
        compiled = run.lower(*args).compile()  # cached: the same shapes compile once per process
        report("generating")
        out_BN = np.asarray(compiled(*args))
    results = []
    for row in out_BN[: len(prompts)].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        results.append(row)
    return results


def generate_from_run(
    run_dir: str,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    *,
    step: int | None = None,
    on_mesh: bool = False,
    overrides: list[str] | None = None,
    eos_id: int | None = None,
    report: Callable[[str], None] | None = None,
) -> list[list[int]]:
    """`generate` with the weights of a run's checkpoint (`step`, latest if None): on one device
    with dense dispatch (`resolve.ONE_DEVICE`), or (`on_mesh`) on the run's mesh with its placement; dotted
    `overrides` change either (`parallel.dispatch=pft`, `mesh.expert=4`, `model.dtype=float32`)."""
    if not on_mesh:  # the user's overrides come after, so they win
        overrides = one_device_overrides() + list(overrides or [])
    cfg, step = RunDir(run_dir).config_at(step, overrides)  # the config that step was written under
    cfg = generation_config(cfg)
    devices = jax.devices() if on_mesh else jax.devices()[:1]
    mesh = sharding.make_mesh(cfg.mesh, devices)
    cfg = resolve_placement(cfg, exchange_devices(mesh))
    if report is not None:
        report(f"loading step {step} of {run_dir} onto {mesh.size} device(s)")
    with jax.set_mesh(mesh):
        params, bias = load_weights(run_dir, cfg, step, mesh)
    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    return generate(
        spec, params, bias, prompts, max_new_tokens, sampling, seed, mesh=mesh, eos_id=eos_id, report=report
    )
