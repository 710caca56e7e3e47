"""The NNX model: abstract specs of full-size configs, logical axes, mesh invariance, GQA, causality."""

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
from reference import attention_ref, rel_err

from xmoe_jax import count_params
from xmoe_jax.config import MeshConfig, ModelConfig, ParallelConfig, load_config
from xmoe_jax.model import apply, init_params, model_spec
from xmoe_jax.model.layers import Attention
from xmoe_jax.sharding import PARAM_RULES, logical_to_spec, make_mesh
from xmoe_jax.train.step import stack_layers

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
FULL_SIZE = [
    "small",
    "medium",
    "large",
    "super",
    "deepseek_moe_16b",
    "deepseek_v2_lite",
    pytest.param("deepseek_v3", marks=pytest.mark.slow),  # ~11 s
]
B, S = 8, 16


def _leaves_with_paths(tree) -> list:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: isinstance(n, tuple))[0]


def _tiny(**moe) -> ModelConfig:
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.dtype=float32"]).model
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe)) if moe else cfg


# ----------------------------------------------------------------------------- abstract specs


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_spec_matches_param_count(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.yaml").model
    spec = model_spec(cfg)  # abstract: a 545B model must not allocate
    leaves = jax.tree.leaves(spec.params_shape)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(math.prod(x.shape) for x in leaves) == count_params(cfg).total
    assert all(x.dtype == jnp.dtype(cfg.param_dtype) for x in leaves)
    bias_leaves = jax.tree.leaves(spec.bias_shape)
    moe_blocks = cfg.num_moe_layers + cfg.mtp_depth  # an MTP module's block is MoE too
    assert sum(x.shape[0] for x in bias_leaves) == (moe_blocks if cfg.moe.has_router_bias else 0)
    _check_logical(spec)


def _check_logical(spec) -> None:
    for shapes, logical in ((spec.params_shape, spec.params_logical), (spec.bias_shape, spec.bias_logical)):
        shape_leaves = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
        name_leaves = dict(_leaves_with_paths(logical))
        assert shape_leaves.keys() == name_leaves.keys()
        for path, x in shape_leaves.items():
            names = name_leaves[path]
            assert isinstance(names, tuple) and len(names) == len(x.shape), (path, names, x.shape)
            assert all(n is None or n in PARAM_RULES for n in names), (path, names)
            logical_to_spec(names, PARAM_RULES)  # every name has a rule
            stacked = getattr(path[0], "key", None) in ("dense_layers", "moe_layers", "mtp_layers")
            assert (names[0] == "layers") == stacked, (path, names)  # a layer stack's leading axis
            if any(getattr(k, "key", None) == "experts" for k in path):
                assert names[stacked] == "experts", (path, names)


def test_router_bias_lives_in_bias_tree_only_for_sigmoid() -> None:
    softmax_spec = model_spec(_tiny())
    assert jax.tree.leaves(softmax_spec.bias_shape) == []
    sigmoid_cfg = _tiny(score_func="sigmoid", num_groups=2, topk_groups=1)
    spec = model_spec(sigmoid_cfg)
    flat = jax.tree_util.tree_flatten_with_path(spec.bias_shape)[0]
    assert len(flat) == 1  # one [L, E] bias for the MoE layer stack
    for path, x in flat:
        assert x.shape == (sigmoid_cfg.num_moe_layers, sigmoid_cfg.moe.num_experts) and x.dtype == jnp.float32
        assert [getattr(k, "key", None) for k in path[-3:]] == ["moe", "router", "bias"]
    # the bias is not a trainable parameter and not counted
    param_paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(spec.params_shape)[0]
    ]
    assert not any("bias" in p for p in param_paths)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(spec.params_shape))
    assert n_params == count_params(sigmoid_cfg).total
    _check_logical(spec)


# ----------------------------------------------------------------------------- tiny model numerics


@functools.cache
def _mesh():
    return make_mesh(MeshConfig(data=2, expert=4))


@functools.cache
def _spec(dispatch: str):
    return model_spec(_tiny(), ParallelConfig(dispatch=dispatch))


@functools.cache
def _init(with_mesh: bool):
    """(params, bias) of the tiny model; the dispatch mode does not change the tree."""
    return init_params(_spec("dense"), jax.random.key(0), mesh=_mesh() if with_mesh else None)


@functools.cache
def _apply_fn(dispatch: str, with_mesh: bool):
    spec = _spec(dispatch)
    fn = jax.jit(lambda p, b, t: (lambda logits, stats: (logits, stack_layers(stats)))(*apply(spec, p, b, t)))
    if not with_mesh:
        return fn

    def on_mesh(*args):
        with jax.set_mesh(_mesh()):
            return fn(*args)

    return on_mesh


def _tokens(seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (B, S), 0, 256)


@pytest.mark.parametrize("dispatch", [pytest.param("dense", marks=pytest.mark.slow), "padded"])  # dense ~37 s
def test_tiny_logits_same_on_mesh(dispatch: str) -> None:
    spec = _spec(dispatch)
    params, bias = _init(False)
    tokens = _tokens()
    logits_ref, aux_ref = _apply_fn(dispatch, False)(params, bias, tokens)
    # parameters created directly in their sharded layout are the same numbers
    params_m, bias_m = _init(True)
    assert jax.tree.structure(params_m) == jax.tree.structure(params)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, params_m, params))) == 0.0
    logits, aux = _apply_fn(dispatch, True)(params_m, bias_m, tokens)
    assert logits.shape == (B, S, spec.cfg.vocab_size) and logits.dtype == jnp.float32
    assert rel_err(logits, logits_ref) < 1e-5
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    assert aux.tokens_per_expert.shape == (spec.cfg.num_moe_layers, spec.cfg.moe.num_experts)


def test_causality() -> None:
    params, bias = _init(False)
    fn = _apply_fn("dense", False)
    tokens = _tokens(1)
    t = 9
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
    logits, _ = fn(params, bias, tokens)
    logits2, _ = fn(params, bias, changed)
    np.testing.assert_allclose(np.asarray(logits2[:, :t]), np.asarray(logits[:, :t]), rtol=1e-6, atol=1e-6)
    # every sequence sees the change from position t on
    assert float(jnp.abs(logits2[:, t] - logits[:, t]).max(-1).min()) > 1e-4


def test_gqa_attention_matches_numpy_reference() -> None:
    cfg = ModelConfig(
        hidden=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_layers=1,
        num_dense_layers=1,
        moe=None,
        dtype="float32",
        init_std=0.3,
        rope_theta=100.0,
    )
    attn = Attention(cfg, nnx.Rngs(params=0))
    x = jax.random.normal(jax.random.key(3), (2, 12, 32), jnp.float32)
    y = attn(x)
    weights = [np.asarray(w[...]) for w in (attn.wq, attn.wk, attn.wv, attn.wo)]
    assert weights[1].shape == (32, 2, 8) and weights[0].shape == (32, 4, 8)
    for b in range(x.shape[0]):
        want = attention_ref(np.asarray(x[b]), *weights, theta=cfg.rope_theta)
        assert rel_err(y[b], want) < 1e-5


@pytest.mark.parametrize(
    "qkv_bias, qk_norm", [(True, "none"), (False, "head"), (False, "full"), (True, "full")]
)
def test_attention_bias_and_qk_norm_match_numpy_reference(qkv_bias: bool, qk_norm: str) -> None:
    cfg = ModelConfig(
        hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1, num_dense_layers=1, moe=None,
        dtype="float32", init_std=0.3, rope_theta=100.0, qkv_bias=qkv_bias, qk_norm=qk_norm,
    )  # fmt: skip
    attn = Attention(cfg, nnx.Rngs(params=0))
    keys = iter(jax.random.split(jax.random.key(5), 8))
    for _, var in nnx.iter_graph(attn):  # biases start at zero and scales at one: make them count
        if isinstance(var, nnx.Param) and var[...].ndim < 3:
            var[...] = var[...] + 0.3 * jax.random.normal(next(keys), var[...].shape)
    x = jax.random.normal(jax.random.key(3), (2, 12, 32), jnp.float32)
    y = attn(x)
    weights = [np.asarray(w[...]) for w in (attn.wq, attn.wk, attn.wv, attn.wo)]
    bias = tuple(np.asarray(b[...]) for b in (attn.bq, attn.bk, attn.bv)) if qkv_bias else None
    norm = None
    if qk_norm != "none":
        norm = (qk_norm, np.asarray(attn.q_norm.scale[...]), np.asarray(attn.k_norm.scale[...]))
        assert norm[1].shape == ((8,) if qk_norm == "head" else (4, 8))
    for b in range(x.shape[0]):
        want = attention_ref(np.asarray(x[b]), *weights, theta=cfg.rope_theta, bias=bias, qk_norm=norm)
        assert rel_err(y[b], want) < 1e-5


@pytest.mark.slow  # ~23 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_tied_embeddings_share_the_embedding_as_head() -> None:
    cfg = dataclasses.replace(_tiny(), tie_embeddings=True)
    spec = model_spec(cfg)
    assert "lm_head" not in spec.params_shape
    params, bias = init_params(spec, jax.random.key(0))
    tokens = _tokens()
    logits, _ = apply(spec, params, bias, tokens)
    hidden_spec = dataclasses.replace(cfg, tie_embeddings=False)
    untied = {**params, "lm_head": params["embed"].T}  # the same model, untied
    want, _ = apply(model_spec(hidden_spec), untied, bias, tokens)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))


def test_fsdp_splits_non_expert_weights_over_data_and_expert():
    """FSDP: attention/dense weights split their model dim over data x expert (not replicated over
    the expert axes); expert weights keep experts on the expert axes and take data; a dim the whole
    group does not divide keeps the leading axes that do."""
    from xmoe_jax.model.functional import shardings

    cfg = load_config(CONFIGS / "tiny.yaml", ["mesh.data=2", "mesh.expert=4"])
    spec = model_spec(cfg.model, cfg.parallel)
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    params_sh, _ = shardings(spec, mesh, fsdp=True)
    flat = {jax.tree_util.keystr(k): s.spec for k, s in jax.tree_util.tree_leaves_with_path(params_sh)}
    wq = next(v for k, v in flat.items() if k.endswith("['wq']"))
    w_up = next(v for k, v in flat.items() if "experts" in k and k.endswith("['w_up']"))
    assert wq[1] == ("data", "expert_node", "expert")  # [layers, embed, heads, head_dim]
    assert w_up[1:3] == (("expert_node", "expert"), "data")  # [layers, experts, embed, expert_mlp]
    from jax.sharding import PartitionSpec as P

    from xmoe_jax.sharding import FSDP_AXES, named_sharding, param_rules

    odd = named_sharding(mesh, ("embed",), (6,), param_rules(fsdp=True), prefix=True).spec
    assert odd == P(("data", "expert_node")) and FSDP_AXES[0] == "data"  # 6 % 8 != 0, 6 % 2 == 0


# ----------------------------------------------------------------------------- init


def _looped(make, rngs, num):
    """The per-layer init the stacks replaced: `num` modules one after another, then stacked."""
    states = [nnx.split(make(rngs))[1] for _ in range(num)]
    graphdef = nnx.split(make(nnx.Rngs(params=0)))[0]
    return nnx.merge(graphdef, jax.tree.map(lambda *a: jnp.stack(a), *states))


@pytest.mark.slow  # ~30 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_vmapped_stack_init_equals_the_per_layer_init() -> None:
    """The layer stacks are created by one vmapped init (start-up flat in depth); every weight
    equals, bitwise, that of creating the layers one after another from the same stream, which
    then stands where the loop would leave it (an MoE block: attention, router, experts)."""
    from xmoe_jax.model.block import Block
    from xmoe_jax.model.transformer import _stacked

    cfg = dataclasses.replace(_tiny(), hidden=16, num_heads=2, num_kv_heads=1, head_dim=8)

    def make(rngs):
        return Block(cfg, True, rngs, ParallelConfig())

    def init(stack, key):
        rngs = nnx.Rngs(params=key)
        rngs.params()  # a stream already in use, as after the embedding
        weights = nnx.to_pure_dict(nnx.split(stack(make, rngs, 3))[1])
        return weights, rngs.params.count[...]

    key = jax.random.key(3)
    one = jax.eval_shape(functools.partial(init, lambda make, rngs, _: _stacked(make, rngs, 1)), key)[0]
    assert one["attn"]["wq"].shape == (1, 16, 2, 8)
    stacked, count = jax.jit(functools.partial(init, _stacked))(key)
    looped, looped_count = jax.jit(functools.partial(init, _looped))(key)
    assert jax.tree.structure(stacked) == jax.tree.structure(looped) and int(count) == int(looped_count)
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(looped), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert stacked["attn"]["wq"].shape == (3, 16, 2, 8)
