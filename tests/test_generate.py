"""Generation: KV-cached decoding equals the full-sequence forward (MHA with q/k/v bias and q/k
norms; MLA with its latent cache: configs/tiny_deepseek.yaml); sampling; the mesh."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import rel_err

from xmoe_jax.cli_models import generate_main
from xmoe_jax.config import ConfigError, MeshConfig, ParallelConfig, load_config
from xmoe_jax.generate import SamplingConfig, generate, sample
from xmoe_jax.generate.sampling import MIN_TEMPERATURE
from xmoe_jax.model import apply, init_params, model_spec
from xmoe_jax.model import functional as fmodel
from xmoe_jax.model.kv_cache import init_cache
from xmoe_jax.sharding import make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [42]]  # different lengths: left-padded
NUM_NEW = 6


@functools.cache
def _model(kind: str = "mha"):
    if kind == "mla":  # latent cache, YaRN, query latent; sigmoid routing with a non-zero bias
        cfg = load_config(CONFIGS / "tiny_deepseek.yaml", ["model.dtype=float32"]).model
        spec = model_spec(cfg)
        params, bias = init_params(spec, jax.random.key(0))
        bias = jax.tree.map(lambda b: 0.1 * jax.random.normal(jax.random.key(2), b.shape), bias)
        return spec, params, bias
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.dtype=float32"]).model
    cfg = dataclasses.replace(cfg, qkv_bias=True, qk_norm="head")  # the new attention options too
    spec = model_spec(cfg)
    params, bias = init_params(spec, jax.random.key(0))
    for stack in ("dense_layers", "moe_layers"):  # biases start at zero: make them count
        attn = params[stack]["attn"]
        attn["bk"] = attn["bk"] + 0.5 * jax.random.normal(jax.random.key(1), attn["bk"].shape)
    return spec, params, bias


def _full_forward_greedy(spec, params, bias, prompts, num_new) -> list[list[int]]:
    """Reference: the whole sequence through `apply` each step (right-padded: causal), argmax."""
    width = max(map(len, prompts)) + num_new
    fn = jax.jit(lambda t: apply(spec, params, bias, t)[0])
    seqs = [list(p) for p in prompts]
    for _ in range(num_new):
        tokens = np.zeros((len(seqs), width), np.int32)
        for b, s in enumerate(seqs):
            tokens[b, : len(s)] = s
        logits = np.asarray(fn(tokens))
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(logits[b, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


@pytest.mark.parametrize("kind", ["mha", pytest.param("mla", marks=pytest.mark.slow)])  # mla ~35 s
def test_greedy_equals_full_forward(kind) -> None:
    spec, params, bias = _model(kind)
    got = generate(spec, params, bias, PROMPTS, NUM_NEW, SamplingConfig(temperature=0.0))
    assert got == _full_forward_greedy(spec, params, bias, PROMPTS, NUM_NEW)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_prefill_and_decode_logits_equal_full_forward(kind) -> None:
    spec, params, bias = _model(kind)
    tokens = np.asarray([[0, 0, 0, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7]], np.int32)  # row 0 left-padded
    first = np.asarray([3, 0], np.int32)
    decode = jax.jit(functools.partial(fmodel.decode, spec))
    cache = init_cache(spec.cfg, 2, 9, first)
    if kind == "mla":  # the latent and the RoPE key: C + R numbers per token and layer
        assert [a.shape[-1] for a in cache.kv["moe_layers"]] == [32, 8]
    prefill, cache = decode(params, bias, tokens[:, :-1], cache)
    step, cache = decode(params, bias, tokens[:, -1:], cache)
    assert int(cache.index) == 7
    for b in range(2):
        row = tokens[b : b + 1, first[b] :]
        full, _ = jax.jit(functools.partial(apply, spec))(params, bias, row)
        assert rel_err(prefill[b], full[0, -2]) < 1e-5
        assert rel_err(step[b], full[0, -1]) < 1e-5


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_greedy_on_the_training_mesh_equals_one_device(kind) -> None:
    spec, params, bias = _model(kind)
    want = generate(spec, params, bias, PROMPTS, NUM_NEW, SamplingConfig(temperature=0.0))
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    pft = model_spec(spec.cfg, ParallelConfig(dispatch="pft"))
    placed = jax.device_put((params, bias), fmodel.shardings(pft, mesh))
    got = generate(pft, *placed, PROMPTS, NUM_NEW, SamplingConfig(temperature=0.0), mesh=mesh)
    assert got == want


@pytest.mark.slow  # ~23 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_sampling_is_seeded_and_respects_top_k_and_top_p() -> None:
    spec, params, bias = _model()
    warm = SamplingConfig(temperature=1.0, top_p=0.9)
    first = generate(spec, params, bias, PROMPTS, 4, warm, seed=1)
    assert first == generate(spec, params, bias, PROMPTS, 4, warm, seed=1)  # compiled once, same draws
    # a known distribution: p = [.5, .3, .15, .05]
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    for cfg, allowed in [
        (SamplingConfig(top_p=0.7), {0, 1}),  # .5 < .7, then .8 reaches it
        (SamplingConfig(top_p=0.85), {0, 1, 2}),
        (SamplingConfig(top_k=3), {0, 1, 2}),
        (SamplingConfig(temperature=2.0, top_k=1), {0}),  # top-1 is greedy at any temperature
        (SamplingConfig(temperature=0.0), {0}),
        (SamplingConfig(), {0, 1, 2, 3}),
    ]:
        drawn = np.asarray(sample(logits, jax.random.key(0), cfg))
        assert set(drawn.tolist()) == allowed
    drawn = np.asarray(sample(logits, jax.random.key(0), SamplingConfig()))
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_bad_requests_are_refused() -> None:
    spec, params, bias = _model()
    with pytest.raises(ConfigError, match="max_seq_len"):
        generate(spec, params, bias, [[1]], spec.cfg.max_seq_len)
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(spec, params, bias, [[spec.cfg.vocab_size]], 2)
    with pytest.raises(ConfigError, match="top-p"):
        SamplingConfig(top_p=0.0)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temperature", "nan"),  # old code: token 0 at every step, exit 0
        ("--temperature", "1e-45"),  # the same: logits / 1e-45 overflow to +-inf
        ("--temperature", "inf"),
        ("--temperature", "-1"),
        ("--top-p", "nan"),
        ("--top-p", "1.5"),
        ("--top-k", "-1"),
    ],
)
def test_sampling_numbers_are_refused_before_anything_loads(flag, value, tmp_path, capsys) -> None:
    argv = ["--run-dir", str(tmp_path / "no_run"), "--prompt", "x", flag, value]
    assert generate_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}=") and err.count("\n") == 1, err


def test_the_smallest_temperature_still_samples_the_likely_token() -> None:
    logits = jnp.asarray([[1.0, 3.0, 2.0, -1.0]] * 64)
    drawn = sample(logits, jax.random.key(0), SamplingConfig(temperature=MIN_TEMPERATURE))
    assert set(np.asarray(drawn).tolist()) == {1}  # near-greedy, never the overflowed token 0
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=MIN_TEMPERATURE / 2)


def test_generation_reports_its_stages_and_checks_eos_id() -> None:
    spec, params, bias = _model()
    lines: list[str] = []
    generate(spec, params, bias, PROMPTS, 2, SamplingConfig(temperature=0.0), report=lines.append)
    assert [line.split(":")[0] for line in lines] == ["compiling generation", "generating"]
    with pytest.raises(ConfigError, match="--eos-id"):
        generate(spec, params, bias, PROMPTS, 2, eos_id=spec.cfg.vocab_size)
