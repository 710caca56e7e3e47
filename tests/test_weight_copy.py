"""The compute-dtype copy of the weights (`train.weight_copy`, train/weight_copy.py): on the model
families whose matrices it copies, the loss and every gradient read through the copies are the
masters', bit for bit (the same casts, made one step earlier); a train step with it and one without
make the same update (to float32 rounding: XLA compiles the two updates' arithmetic differently, and
later steps' bf16 casts can round those ulps apart); after every step the copy is its master cast, and
a step the guard does not keep leaves it as it was; checkpoints never hold it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xmoe_jax.config import load_config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.sharding import make_mesh
from xmoe_jax.train import state as tstate
from xmoe_jax.train import weight_copy
from xmoe_jax.train.step import batch_sharding, make_train_step

STEPS = 2  # the first step's learning rate is 0 (warmup): the second moves the weights


def _cfg(path: str, copy: bool, *sets: str):
    return load_config(
        path, overrides=[f"train.weight_copy={str(copy).lower()}", f"train.steps={STEPS}", *sets]
    )


def _run(cfg, devices: int = 1):
    """The state after STEPS steps of random tokens on the first `devices` devices, and each step's loss
    and grad norm."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:devices])
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    with jax.set_mesh(mesh):
        layout = tstate.build(cfg, mesh)
        state, seen = layout.init(cfg, mesh), []
        step = make_train_step(layout.spec, layout.optimizer, cfg, mesh, layout.shardings)
        data_sh = batch_sharding(mesh, cfg)
        for i in range(STEPS):
            tokens = jax.random.randint(jax.random.key(i), (2, *shape), 0, cfg.model.vocab_size)
            batch = {
                k: jax.device_put(t, data_sh) for k, t in zip(("inputs", "targets"), tokens, strict=True)
            }
            state, metrics = step(state, batch)
            seen.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return state, np.array(seen)


CASES = {
    # GELU routed experts, MHA, the LM head (the one-GPU benchmark's model family)
    "tiny": ("configs/tiny.yaml", "model.dtype=bfloat16"),
    # MLA, SwiGLU shared experts and dense layers, MTP, micro-batches (float32 gradient sums)
    "deepseek_micro": ("configs/tiny_deepseek.yaml", "model.dtype=bfloat16", "train.micro_batch_size=2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_through_the_copies_are_the_masters_bit_for_bit(case):
    """A leaf used in float32 anywhere (the router, a norm, the embedding's scatter-add) would differ."""
    path, *sets = CASES[case]
    cfg = _cfg(path, True, *sets)
    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    params, bias = fmodel.init_params(spec, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 4, cfg.train.seq_len), 0, cfg.model.vocab_size)

    def loss(p):
        ce, mtp, stats = fmodel.loss_terms(spec, p, bias, tokens[0], tokens[1])
        aux = sum(s.aux_loss.sum() for s in stats.values())
        return ce + mtp + 0.01 * aux

    grad = jax.jit(jax.value_and_grad(loss))
    loss_m, g_masters = grad(params)
    loss_c, g_copies = grad(weight_copy.merged(params, weight_copy.copies(params, weight_copy.plan(cfg, 1))))
    assert float(loss_m) == float(loss_c)
    flat = jax.tree_util.tree_flatten_with_path(g_masters)[0]
    for (key, a), b in zip(flat, jax.tree.leaves(g_copies), strict=True):
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b.astype(a.dtype)), err_msg=jax.tree_util.keystr(key)
        )


@pytest.mark.parametrize(
    "case", [c if c == "tiny" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)  # the DeepSeek-style pair compiles two MLA + MTP steps: slow
def test_train_steps_with_the_copy_match_those_without(case):
    path, *sets = CASES[case]
    with_copy, seen_with = _run(_cfg(path, True, *sets))
    without, seen_without = _run(_cfg(path, False, *sets))
    assert without.weights is None and with_copy.weights is not None
    np.testing.assert_allclose(seen_with, seen_without, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(with_copy.params), jax.tree.leaves(without.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    # after every step the copy is its master cast; the leaves not copied have none
    copies = jax.tree.leaves(
        weight_copy.copies(with_copy.params, weight_copy.plan(_cfg(path, True, *sets), 1))
    )
    assert len(copies) == len(jax.tree.leaves(with_copy.weights)) > 0
    for a, b in zip(jax.tree.leaves(with_copy.weights), copies, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    assert "weights" not in with_copy.as_dict()


def test_the_copied_leaves_are_the_cast_matrices_only():
    """The embedding (a scatter-add gradient), the router kernel, norm scales and biases stay masters,
    and the LM head under MTP (two uses); no copy under FP8 or with params in the compute dtype."""
    cfg = _cfg("configs/tiny_deepseek.yaml", True, "model.dtype=bfloat16", "model.mtp_depth=0")
    spec_shape = fmodel.model_spec(cfg.model, cfg.parallel).params_shape

    def copied(cfg):
        flat = jax.tree_util.tree_flatten_with_path(weight_copy.copies(spec_shape, weight_copy.plan(cfg, 1)))[
            0
        ]
        return {jax.tree_util.keystr(path) for path, _ in flat}

    names = copied(cfg)
    assert "['embed']" not in names and "['lm_head']" in names
    assert "['moe_layers']['moe']['experts']['w_up']" in names and "['moe_layers']['attn']['wkv_b']" in names
    assert not any("router" in k or "scale" in k for k in names)
    assert weight_copy.plan(cfg, 1).dtype == jnp.bfloat16
    assert "['lm_head']" not in copied(_cfg("configs/tiny_deepseek.yaml", True, "model.dtype=bfloat16"))
    assert (
        weight_copy.plan(
            _cfg("configs/tiny_deepseek.yaml", True, "model.dtype=bfloat16", "model.param_dtype=bfloat16"), 1
        )
        is None
    )
    assert weight_copy.plan(_cfg("configs/tiny_deepseek.yaml", False, "model.dtype=bfloat16"), 1) is None
    assert weight_copy.plan(_cfg("configs/tiny_deepseek.yaml", True), 1) is None  # float32 compute
    assert weight_copy.plan(cfg, 2) is None  # several devices (weight_copy.py says why)


def test_a_step_the_guard_does_not_keep_leaves_the_copies():
    from xmoe_jax.config import OptimizerConfig
    from xmoe_jax.train.optimizer import guarded_update, make_optimizer, update_bound

    cfg = OptimizerConfig(warmup_steps=0)
    opt = make_optimizer(cfg, 10)
    params = {"w_up": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4), "scale": jnp.ones(4)}
    copy = weight_copy.Plan(jnp.bfloat16, weight_copy.COPIED)
    weights = weight_copy.copies(params, copy)
    grads = {"w_up": jnp.full((3, 4), 0.5, jnp.bfloat16), "scale": jnp.full(4, 0.25)}
    state = opt.init(params)
    for allowed, nan in ((True, False), (False, False), (True, True)):
        g = jax.tree.map(lambda x: x * jnp.nan, grads) if nan else grads
        p, _, _, finite, w = guarded_update(
            opt, params, state, g, jnp.asarray(allowed), update_bound(cfg, 10)
        )
        assert w is None  # no copies given, none made
        p, _, _, finite, w = guarded_update(
            opt, params, state, g, jnp.asarray(allowed), update_bound(cfg, 10), weights
        )
        kept = allowed and not nan
        assert bool(finite) == (not nan) and w["scale"] is None
        assert np.array_equal(np.asarray(w["w_up"]), np.asarray(p["w_up"].astype(jnp.bfloat16)))
        assert np.array_equal(np.asarray(p["w_up"]) != np.asarray(params["w_up"]), np.full((3, 4), kept))


def test_a_restored_state_makes_its_copies_from_the_params(tmp_path):
    """Checkpoints hold no copies (`as_dict`); restore makes them, equal to the ones the run had."""
    from xmoe_jax.train.checkpoint import Checkpointer

    cfg = _cfg("configs/tiny.yaml", True, "model.dtype=bfloat16")
    state, _ = _run(cfg)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    layout = tstate.build(cfg, mesh)
    with Checkpointer(tmp_path / "checkpoints", cfg.checkpoint) as ckpt:
        ckpt.save(STEPS, state.as_dict(), None, cfg, force=True)
    with jax.set_mesh(mesh), Checkpointer(tmp_path / "checkpoints", cfg.checkpoint) as ckpt:
        step, restored = tstate.restore(ckpt, layout, cfg.model.num_dense_layers, STEPS)
    assert step == STEPS and restored.weights is not None
    for a, b in zip(jax.tree.leaves(restored.weights), jax.tree.leaves(state.weights), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16 and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_the_planner_counts_the_copies():
    """xmoe-plan's state bytes per parameter: the copies, and their gradients in bf16."""
    from xmoe_jax.plan import state_bytes_per_param

    cfg = _cfg("configs/tiny.yaml", True, "model.dtype=bfloat16")
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = tstate.build(cfg, mesh).abstract()
    got = state_bytes_per_param(cfg, state)
    total = sum(x.size for x in jax.tree.leaves(state.params))
    copied = sum(x.size for x in jax.tree.leaves(state.weights))
    assert 0 < copied < total
    assert got["copies"] == pytest.approx(2 * copied / total)
    assert got["gradients"] == pytest.approx(4 - 2 * copied / total)
    without = state_bytes_per_param(cfg, tstate.build(_cfg("configs/tiny.yaml", False), mesh).abstract())
    assert "copies" not in without and without["gradients"] == pytest.approx(4)
