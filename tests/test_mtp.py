"""Multi-token prediction (model/mtp.py): the loss equals each module run on the unpadded prefix
that has targets; off by default; turning it on leaves the main model's weights as they were;
the trainer adds it with its weight, and a DeepSeek-shaped tiny model (MLA, node-limited
routing over rbd, MTP) trains."""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xmoe_jax.config import load_config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.train.loop import train

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
B, S = 4, 12


@functools.cache
def _model(depth: int):
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.dtype=float32", f"model.mtp_depth={depth}"]).model
    spec = fmodel.model_spec(cfg)
    return spec, *fmodel.init_params(spec, jax.random.key(0))


def _ce(model, h_BSD, targets_BS) -> jax.Array:
    logits = jnp.einsum("bsd,dv->bsv", h_BSD, model.head()).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


@pytest.mark.slow  # ~43 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_mtp_loss_equals_each_module_on_its_unpadded_prefix() -> None:
    spec, params, bias = _model(2)
    tokens = jax.random.randint(jax.random.key(1), (B, S + 1), 0, 256)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ce, mtp, stats = fmodel.loss_terms(spec, params, bias, inputs, targets)
    assert set(stats) == {"moe_layers/moe", "mtp_layers/block/moe"}
    assert stats["mtp_layers/block/moe"].tokens_per_expert.shape == (2, 8)  # [depth, E]
    # by hand: module k reads h^{k-1} and the embeddings of targets[k-1 : S-1] on S-k positions
    model = nnx.merge(spec.graphdef, params, bias)
    h, _ = model(inputs)
    assert float(ce) == pytest.approx(float(_ce(model, h, targets)), rel=1e-6)
    graphdef, state = nnx.split(model.mtp_layers)
    losses = []
    for k in (1, 2):
        module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], state))
        emb = jnp.take(params["embed"], targets[:, k - 1 : S - 1], axis=0)
        h, _ = module(h[:, : S - k], emb)
        losses.append(_ce(model, h, targets[:, k:]))
    assert float(mtp) == pytest.approx(float(sum(losses) / 2), rel=1e-5)


@pytest.mark.slow  # ~14 s; the MTP loss test stays in the default run
def test_mtp_is_off_by_default_and_leaves_the_main_weights_alone() -> None:
    assert load_config(CONFIGS / "tiny.yaml").model.mtp_depth == 0
    spec0, params0, _ = _model(0)
    spec1, params1, _ = _model(1)
    assert "mtp_layers" not in params0
    assert {k: v for k, v in params1.items() if k != "mtp_layers"}.keys() == params0.keys()
    for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves({k: params1[k] for k in params0}), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert params1["mtp_layers"]["eh_proj"].shape == (1, 2, 64, 64)
    tokens = jnp.zeros((2, S), jnp.int32)
    assert float(fmodel.loss_terms(spec0, params0, {}, tokens, tokens)[1]) == 0.0


@pytest.mark.slow  # ~35 s; node-limited rbd alone: test_rbd.py
def test_deepseek_shaped_tiny_model_trains_with_mtp_and_node_limited_rbd(tmp_path) -> None:
    """configs/tiny_deepseek.yaml (MLA with a query latent and YaRN, sigmoid routing in 2 groups,
    one shared expert, MTP depth 1) on 2 nodes x 2 devices with node-limited rbd, data 2."""
    overrides = [
        "train.steps=12", "train.log_every=1", "train.seq_len=32", "train.batch_size=8",
        "checkpoint.enabled=false", f"train.run_dir={tmp_path / 'run'}", "train.tensorboard=false",
        "mesh.data=2", "mesh.expert=4", "mesh.expert_nodes=2",
        "parallel.dispatch=rbd", "parallel.route_groups_by_node=true",
    ]  # fmt: skip
    cfg = load_config(CONFIGS / "tiny_deepseek.yaml", overrides)
    assert cfg.model.attention_type == "mla" and cfg.model.mtp_depth == 1
    records = train(cfg).records
    moe, weight = cfg.model.moe, cfg.model.mtp_loss_weight
    for r in records:  # the logged total is its terms (aux: both MoE stacks)
        want = r["ce"] + moe.aux_loss_weight * r["aux_loss"] + weight * r["mtp_loss"]
        assert math.isclose(r["loss"], want, rel_tol=1e-5)
    assert len(records[0]["expert_load"]) == cfg.model.num_moe_layers + cfg.model.mtp_depth
    first, last = records[0], records[-1]
    assert last["ce"] < first["ce"] - 0.1 and last["mtp_loss"] < first["mtp_loss"] - 0.1


def test_mtp_depth_must_be_non_negative() -> None:
    from xmoe_jax.config import ConfigError

    with pytest.raises(ConfigError, match="mtp_depth=-1"):
        load_config(CONFIGS / "tiny.yaml", ["model.mtp_depth=-1"])
    base = load_config(CONFIGS / "tiny.yaml").model
    assert dataclasses.replace(base, mtp_depth=3).mtp_depth == 3
