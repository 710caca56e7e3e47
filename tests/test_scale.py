"""Training at depth: attention backends, activation checkpointing, scanned layers, gradient
accumulation, the chunked loss and per-layer checkpoints, on 8 fake CPU devices.

Model: the tiny config in float32 (3 layers: 1 dense + 2 MoE, 8 experts top-2), batch 16 of 32
tokens. Each (model config, placement) compiles its loss-and-gradient function once.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trainer_parts
from reference import rel_err

from xmoe_jax.config import MeshConfig, ParallelConfig, load_config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.model.attention import attend, choose
from xmoe_jax.model.loss import chunk_size, chunked_cross_entropy
from xmoe_jax.sharding import make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
B, S = 16, 32
PFT = ParallelConfig(dispatch="pft")
RBD = ParallelConfig(dispatch="rbd")
DENSE = ParallelConfig(dispatch="dense")
LAYOUTS = {
    "pft": (PFT, MeshConfig(data=2, expert=4)),
    "rbd": (RBD, MeshConfig(data=2, expert=4, expert_nodes=2)),
}


def _model(**over):
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.dtype=float32"]).model
    return dataclasses.replace(cfg, **over)


@functools.cache
def _mesh(mesh_cfg: MeshConfig):
    return make_mesh(mesh_cfg)


def _batch(seed: int = 0, batch: int = B):
    tokens = jax.random.randint(jax.random.key(seed), (batch, S + 1), 0, 256)
    return tokens[:, :-1], tokens[:, 1:]


@functools.cache
def _loss_grad(model_cfg, par: ParallelConfig, mesh_cfg: MeshConfig | None):
    spec = fmodel.model_spec(model_cfg, par)
    fn = jax.jit(jax.value_and_grad(lambda p, b, x, y: fmodel.loss(spec, p, b, x, y)[0]))
    mesh = _mesh(mesh_cfg) if mesh_cfg is not None else None

    def run(params, bias, inputs, targets):
        if mesh is None:
            return fn(params, bias, inputs, targets)
        with jax.set_mesh(mesh):
            return fn(params, bias, inputs, targets)

    return spec, run


@functools.cache
def _params(model_cfg):
    spec = fmodel.model_spec(model_cfg)
    return fmodel.init_params(spec, jax.random.key(0))


def _close(got, want, tol=1e-5):
    (loss, grads), (loss_w, grads_w) = got, want
    assert abs(float(loss) - float(loss_w)) <= tol * abs(float(loss_w))
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_w), strict=True
    ):
        assert rel_err(a, b) < tol, jax.tree_util.keystr(path)


def _run(model_cfg, par, mesh_cfg, seed=0):
    _, run = _loss_grad(model_cfg, par, mesh_cfg)
    params, bias = _params(dataclasses.replace(model_cfg, remat="none", unroll_layers=False, attention="xla"))
    return run(params, bias, *_batch(seed))


# ----------------------------------------------------------------------------- attention backends


def test_attention_backends_agree_with_gqa_and_gradients():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 128, 4, 16))
    k, v = (jax.random.normal(key, (2, 128, 2, 16)) for key in (kk, kv))  # GQA: 2 kv heads
    assert choose("auto", q, k) == "xla"  # CPU
    want = attend(q, k, v, "xla")
    assert rel_err(attend(q, k, v, "pallas"), want) < 1e-5  # interpret mode on CPU

    def grads(impl):
        return jax.grad(lambda *a: jnp.sum(attend(*a, impl) ** 2), argnums=(0, 1, 2))(q, k, v)

    for a, b in zip(grads("pallas"), grads("xla"), strict=True):
        assert rel_err(a, b) < 1e-5
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert choose("cudnn", q, k) == "xla"  # named but impossible here: falls back, says why
    assert any("cudnn" in str(w.message) for w in seen)


def test_pallas_attention_falls_back_to_xla_where_jax_no_longer_ships_it(monkeypatch):
    """jax 0.12.1 removed jax.experimental.pallas.ops.gpu.attention: `pallas` (ROCm's `auto` pick) then runs
    XLA's attention and says why once, instead of failing at the import inside the step."""
    from xmoe_jax.model import attention

    monkeypatch.setattr(attention, "pallas_attention_module", lambda: None)
    attention._warn_once.cache_clear()  # said once per process: an earlier test may have said it
    q = jnp.ones((1, 128, 2, 16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert choose("pallas", q, q) == "xla"
    assert any("no longer ships" in str(w.message) for w in seen), [str(w.message) for w in seen]


@pytest.mark.slow  # ~13 s; the backends agree: test_attention_backends_agree_with_gqa_and_gradients
def test_model_with_pallas_attention_on_a_mesh_equals_xla():
    base = _model(attention="xla")
    _close(_run(_model(attention="pallas"), PFT, LAYOUTS["pft"][1]), _run(base, PFT, LAYOUTS["pft"][1]))


# ----------------------------------------------------------------------------- remat, scan


@pytest.mark.parametrize(
    "layout, mode",
    [
        pytest.param("pft", "full", marks=pytest.mark.slow),  # ~52 s: the default suite keeps the two below
        ("pft", "save_dots"),
        ("pft", "save_exchange"),
        *(
            pytest.param(layout, mode, marks=pytest.mark.slow)  # ~5-24 s each
            for layout, mode in [
                ("rbd", "save_exchange"),
                ("pft", "save_attention_and_experts"),
                ("pft", "save_sublayer_outputs"),
                ("rbd", "full"),
                ("rbd", "save_dots"),
                ("rbd", "save_attention_and_experts"),
                ("rbd", "save_sublayer_outputs"),
            ]
        ),
    ],
)
def test_remat_policies_compute_the_same_gradients(layout, mode):
    par, mesh_cfg = LAYOUTS[layout]
    _close(_run(_model(remat=mode), par, mesh_cfg), _run(_model(), par, mesh_cfg), tol=1e-6)


@pytest.mark.parametrize("layout", ["pft", pytest.param("rbd", marks=pytest.mark.slow)])
def test_unrolled_layers_equal_the_scan(layout):
    par, mesh_cfg = LAYOUTS[layout]
    _close(_run(_model(unroll_layers=True), par, mesh_cfg), _run(_model(), par, mesh_cfg), tol=1e-6)


def _compiled(model_cfg, par, mesh_cfg):
    spec = fmodel.model_spec(model_cfg, par)
    fn = jax.jit(jax.grad(lambda p, b, x, y: fmodel.loss(spec, p, b, x, y)[0]))
    x = jax.ShapeDtypeStruct((64, 128), jnp.int32)
    with jax.set_mesh(_mesh(mesh_cfg)):
        return fn.lower(spec.params_shape, spec.bias_shape, x, x).compile()


def _temp_bytes(model_cfg, par, mesh_cfg):
    return _compiled(model_cfg, par, mesh_cfg).memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # ~58 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_remat_lowers_compiled_temporary_memory():
    par, mesh_cfg = LAYOUTS["pft"]
    deep = dict(num_layers=6, num_dense_layers=1)
    none = _temp_bytes(_model(**deep), par, mesh_cfg)
    full = _temp_bytes(_model(remat="full", **deep), par, mesh_cfg)
    sub = _temp_bytes(_model(remat="save_sublayer_outputs", **deep), par, mesh_cfg)
    assert full < sub < none, (full, sub, none)


def _all_to_alls(model_cfg, par, mesh_cfg) -> int:
    return _compiled(model_cfg, par, mesh_cfg).as_text().count(" all-to-all(")


@pytest.mark.slow  # ~66 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
@pytest.mark.parametrize("layout", ["pft", pytest.param("rbd", marks=pytest.mark.slow)])  # rbd ~40 s
def test_save_exchange_runs_each_exchange_as_often_as_no_recomputation(layout):
    """`save_exchange` keeps what the all-to-alls delivered: its step holds as many all-to-alls as
    `none` (forward and transpose), where `full` runs the forward exchanges again."""
    par, mesh_cfg = LAYOUTS[layout]
    counts = {m: _all_to_alls(_model(remat=m), par, mesh_cfg) for m in ("none", "save_exchange", "full")}
    assert counts["save_exchange"] == counts["none"] < counts["full"], counts


@pytest.mark.slow  # ~51 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_remat_holds_when_layers_run_straight_line():
    """Unrolled layers (or a scan whose one iteration holds them all) put the forward and backward
    in one program; XLA's CSE must not merge the recomputation back into the forward (remat.py's
    fence): remat full's program evaluates the recomputed matmuls again, and holds no more than none.
    Measured on this tiny model: 298 dots against none's 230, and 230 with the fence taken out (the
    defect). Its temporaries used to show the defect too (none 171.2 MB, full 158.4, the defect
    169.7), but since the experts' backward ties its recomputed activation to the cotangent
    (moe/experts.py `_tied`) none no longer keeps the activation either: none 168.5, full 167.4.
    On the GPU's Small shapes: 46.9 -> 34.5 GiB."""
    par, mesh_cfg = LAYOUTS["pft"]
    deep = dict(num_layers=6, num_dense_layers=1, unroll_layers=True)
    none = _compiled(_model(**deep), par, mesh_cfg)
    full = _compiled(_model(remat="full", **deep), par, mesh_cfg)
    dots = [c.as_text().count(" dot(") for c in (full, none)]
    assert dots[0] > 1.2 * dots[1], dots
    temp = [c.memory_analysis().temp_size_in_bytes for c in (full, none)]
    assert temp[0] <= temp[1], temp


# ----------------------------------------------------------------------------- chunked loss


def test_chunked_cross_entropy_equals_full_logits():
    kh, kw, kt = jax.random.split(jax.random.key(3), 3)
    h, w = jax.random.normal(kh, (4, 24, 16)), jax.random.normal(kw, (16, 50))
    t = jax.random.randint(kt, (4, 24), 0, 50)

    def full(h, w):
        logp = jax.nn.log_softmax(jnp.einsum("bsd,dv->bsv", h, w), axis=-1)
        return -jnp.take_along_axis(logp, t[..., None], axis=-1).mean()

    assert chunk_size(24, 10) == 8 and chunk_size(24, 0) == 24
    for chunk in (0, 5, 8, 24):
        got = jax.value_and_grad(lambda h, w, c=chunk: chunked_cross_entropy(h, w, t, c), argnums=(0, 1))(
            h, w
        )
        want = jax.value_and_grad(full, argnums=(0, 1))(h, w)
        assert abs(float(got[0]) - float(want[0])) < 1e-5 * float(want[0])
        for a, b in zip(got[1], want[1], strict=True):
            assert rel_err(a, b) < 1e-5


def test_chunked_cross_entropy_counts_only_weighted_positions_and_scales_by_the_cotangent():
    """With 0/1 weights (multi-token prediction) the loss and both gradients equal the masked mean of
    full logits, under a cotangent that is not 1 (the MTP loss weight)."""
    kh, kw, kt, km = jax.random.split(jax.random.key(4), 4)
    h, w = jax.random.normal(kh, (3, 20, 16)), jax.random.normal(kw, (16, 40))
    t = jax.random.randint(kt, (3, 20), 0, 40)
    m = (jax.random.uniform(km, (3, 20)) < 0.7).astype(jnp.float32)

    def full(h, w):
        logp = jax.nn.log_softmax(jnp.einsum("bsd,dv->bsv", h, w), axis=-1)
        return 0.3 * -(jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0] * m).sum() / m.sum()

    got = jax.value_and_grad(
        lambda h, w: 0.3 * chunked_cross_entropy(h, w, t, 4, weights_BS=m), argnums=(0, 1)
    )(h, w)
    want = jax.value_and_grad(full, argnums=(0, 1))(h, w)
    assert abs(float(got[0]) - float(want[0])) < 1e-5 * float(want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert rel_err(a, b) < 1e-5


def test_chunked_cross_entropy_takes_three_vocab_matmuls_per_chunk_not_four():
    """The gradient is taken in the forward pass (model/loss.py): the loss and its gradient run the
    LM head's matmuls three times per chunk (logits, d h, d W), never a fourth to recompute the
    logits in the backward pass; in bfloat16 the result stays within rounding of float32."""
    kh, kw, kt = jax.random.split(jax.random.key(5), 3)
    h, w = jax.random.normal(kh, (2, 16, 8)), jax.random.normal(kw, (8, 24))
    t = jax.random.randint(kt, (2, 16), 0, 24)
    grad = jax.value_and_grad(lambda h, w: chunked_cross_entropy(h, w, t, 4), argnums=(0, 1))

    def vocab_dots(jaxpr) -> int:
        count = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and any(
                24 in v.aval.shape for v in (*eqn.invars, *eqn.outvars)
            ):
                count += 1
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    count += vocab_dots(inner)
        return count

    assert vocab_dots(jax.make_jaxpr(grad)(h, w).jaxpr) == 3
    bf16 = grad(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    f32 = grad(h, w)
    assert abs(float(bf16[0]) - float(f32[0])) < 2e-2 * float(f32[0])
    for a, b in zip(bf16[1], f32[1], strict=True):
        assert a.dtype == jnp.bfloat16 and rel_err(a.astype(jnp.float32), b) < 3e-2


@pytest.mark.slow  # ~16 s; the chunked loss alone: test_chunked_cross_entropy_*
def test_model_loss_chunks_agree():
    _close(
        _run(_model(loss_chunk=8), PFT, LAYOUTS["pft"][1]), _run(_model(loss_chunk=0), PFT, LAYOUTS["pft"][1])
    )


def test_chunked_loss_never_builds_full_logits():
    """The compiled loss+grad has no float32 [B, S, V] logits buffer (per device: 8 x 128 x 4096)."""
    model = dict(vocab_size=4096, num_layers=1, num_dense_layers=1, moe=None)
    # per device [1, B/P, positions, V]: the loss splits the batch into its P = 8 device shards (model/loss.py)
    full_logits = re.compile(r"f32\[(1,)?8,128,4096\]")
    whole = _compiled(_model(loss_chunk=0, **model), DENSE, MeshConfig(data=8))
    chunked = _compiled(_model(loss_chunk=16, **model), DENSE, MeshConfig(data=8))
    assert full_logits.search(whole.as_text()) and not full_logits.search(chunked.as_text())
    assert re.search(r"f32\[(1,)?8,16,4096\]", chunked.as_text())  # one chunk at a time
    assert chunked.memory_analysis().temp_size_in_bytes < whole.memory_analysis().temp_size_in_bytes
    # data parallel: each device sums its own chunks' d W, so no [D, V] all-reduce runs inside the
    # chunk loop (one per chunk before, the LM head's size each); the one after it is the gradients'
    in_loops = [
        line
        for comp in re.split(r"\n(?=\S)", chunked.as_text())
        if not comp.startswith("ENTRY")
        for line in comp.splitlines()
        if " all-reduce" in line and "4096" in line.split(" all-reduce")[0]
    ]
    assert not in_loops, in_loops[:2]


# ----------------------------------------------------------------------------- gradient accumulation


def _step_cfg(tmp_path, *over):
    from xmoe_jax.config import load_config as load

    return load(
        CONFIGS / "tiny.yaml",
        [
            f"train.run_dir={tmp_path}",
            "train.batch_size=16",
            "train.seq_len=32",
            "train.steps=2",
            "model.dtype=float32",
            "mesh.data=2",
            "mesh.expert=4",
            "parallel.dispatch=pft",
            "model.moe.score_func=sigmoid",
            "model.moe.bias_update_rate=0.01",
            *over,
        ],
    )


def _one_step(cfg):
    return trainer_parts.one_step(cfg, *_batch(5))


@pytest.mark.slow  # ~76 s: kept out of the default suite's 15-minute budget (CI's slow run has it)
def test_micro_batches_give_the_same_update(tmp_path):
    """aux-loss weight 0 (the balance loss is per micro-batch by design): the update is the same."""
    over = ("model.moe.aux_loss_weight=0",)
    whole, m_whole = _one_step(_step_cfg(tmp_path / "a", *over))
    micro, m_micro = _one_step(_step_cfg(tmp_path / "b", *over, "train.micro_batch_size=8"))
    assert abs(float(m_whole["loss"]) - float(m_micro["loss"])) < 1e-6 * float(m_whole["loss"])
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(micro.params), jax.tree.leaves(whole.params), strict=True
    ):
        assert rel_err(a, b) < 1e-5, jax.tree_util.keystr(path)
    # the bias rule sees the whole step's loads: the same update
    np.testing.assert_array_equal(m_micro["tokens_per_expert"], m_whole["tokens_per_expert"])
    for a, b in zip(jax.tree.leaves(micro.bias), jax.tree.leaves(whole.bias), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)


def test_a_bfloat16_gradient_sum_is_the_float32_one_to_bfloat16_rounding(tmp_path):
    """train.grad_accum_dtype=bfloat16 (one device, 4 micro-batches): the step's gradient norm is the
    float32 sum's to bf16 rounding, and not bitwise it (the switch acts); the loss is the same."""

    def step(accum):
        cfg = load_config(
            CONFIGS / "tiny.yaml",
            [f"train.run_dir={tmp_path / accum}", f"train.batch_size={B}", f"train.seq_len={S}",
             "train.micro_batch_size=4", "model.dtype=float32", f"train.grad_accum_dtype={accum}"],
        )  # fmt: skip
        return trainer_parts.one_step(cfg, *_batch(7))[1]

    f32, bf16 = step("float32"), step("bfloat16")
    assert float(f32["loss"]) == float(bf16["loss"])
    g32, g16 = float(f32["grad_norm"]), float(bf16["grad_norm"])
    assert g32 != g16 and abs(g16 - g32) < 2**-7 * g32, (g32, g16)


@pytest.mark.slow  # ~16 s
def test_micro_batch_balance_loss_is_the_mean_over_micro_batches(tmp_path):
    cfg = _step_cfg(tmp_path, "train.micro_batch_size=8")
    _, metrics = _one_step(cfg)
    spec, run = _loss_grad(cfg.model, cfg.parallel, cfg.mesh)
    params, bias = fmodel.init_params(spec, jax.random.split(jax.random.key(cfg.train.seed))[0])
    x, y = _batch(5)
    rows = (np.arange(16) % 2 == 0, np.arange(16) % 2 == 1)  # micro-batch m holds rows m, m+2, ...
    from xmoe_jax.train.step import stack_layers

    with jax.set_mesh(_mesh(cfg.mesh)):
        aux = [
            float(stack_layers(fmodel.loss(spec, params, bias, x[r], y[r])[1]).aux_loss.sum()) for r in rows
        ]
    assert abs(float(metrics["aux_loss"]) - np.mean(aux)) < 1e-5 * abs(np.mean(aux))


# ----------------------------------------------------------------------------- per-layer checkpoints


@pytest.mark.slow  # ~55 s: trains, converts and resumes twice
def test_per_layer_checkpoint_restores_into_the_stacks(tmp_path):
    """A checkpoint with one subtree per layer (the layout before layer stacks) resumes exactly."""
    from xmoe_jax.train import layout
    from xmoe_jax.train.checkpoint import Checkpointer
    from xmoe_jax.train.loop import train

    over = ["train.log_every=1", "checkpoint.every=2", "checkpoint.async_save=false", "train.steps=4"]
    full = train(_step_cfg(tmp_path / "full", *over))
    first = train(_step_cfg(tmp_path / "split", *over[:-1], "train.steps=2"))
    assert sorted(first.losses) == [1, 2]
    # rewrite step 2 in the per-layer layout
    ckpt_dir = tmp_path / "split" / "checkpoints"
    cfg = _step_cfg(tmp_path / "split", *over)
    with Checkpointer(ckpt_dir, cfg.checkpoint) as ckpt:
        from xmoe_jax.train import state as tstate

        abstract = tstate.build(cfg, make_mesh(cfg.mesh)).abstract().as_dict()
        state = ckpt.restore(abstract)
        config = ckpt.read_config(2)
    old = tmp_path / "old"
    with Checkpointer(old / "checkpoints", cfg.checkpoint) as ckpt:
        per_layer = layout.per_layer_target(state, cfg.model.num_dense_layers)
        assert "layer_000" in per_layer["params"]["layers"] and "layer_002" in per_layer["bias"]["layers"]
        ckpt.save(2, per_layer, force=True)
        ckpt._manager.wait_until_finished()
    import shutil

    for item in ("data", "config"):
        shutil.copytree(ckpt_dir / "2" / item, old / "checkpoints" / "2" / item)
    assert config["model"]["num_layers"] == 3
    resumed = train(_step_cfg(old, *over), resume=True)
    assert resumed.losses == {3: full.losses[3], 4: full.losses[4]}


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpu_attention_backends_equal_xla_in_bf16(impl):
    """On a GPU: the fast backends against XLA's attention in float32, bf16 inputs, GQA, gradients."""
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (2, 1024, 16, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 1024, 4, 128), jnp.bfloat16) for key in (kk, kv))
    if impl == "cudnn" and choose("cudnn", q, k) != "cudnn":
        pytest.skip("cuDNN attention needs an NVIDIA GPU")
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]

    def loss(impl, *args):
        return jnp.sum(attend(*args, impl).astype(jnp.float32) ** 2)

    assert rel_err(attend(q, k, v, impl), attend(*f32, "xla")) < 1e-2
    got = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(*f32)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 2e-2


@pytest.mark.slow  # ~30 s: two CPU compiles of the whole step
@pytest.mark.parametrize("transport", ["bucketed", "push"])
def test_no_conditional_runs_inside_the_layer_scan_or_micro_batch_loop(transport):
    """Issue 35 item 5 asks whether the scan body holds a `cond`, which makes XLA copy the whole carry every
    iteration (jax#38145). The compiled step (EP 4, save_exchange, 2 micro-batches, 4 scanned layers) holds one
    conditional, the optimizer's guard in the entry computation, and none inside a while loop."""
    from xmoe_jax.perf.lowering import compiled_train_step_text

    cfg = load_config(
        "configs/tiny.yaml",
        [
            "parallel.dispatch=pft", "mesh.data=1", "mesh.expert=4", "train.batch_size=8", "train.seq_len=64",
            "model.remat=save_exchange", f"parallel.transport={transport}", "model.num_layers=4",
            "train.micro_batch_size=4",
        ],
    )  # fmt: skip
    text = compiled_train_step_text(cfg, 4)
    computations = re.split(r"\n(?=\S)", text)
    with_cond = [c.split("(")[0] for c in computations if " conditional(" in c]
    assert len(with_cond) == 1 and with_cond[0].startswith("ENTRY"), with_cond
    assert text.count(" conditional(") == 1
    assert sum(" while(" in c for c in computations) >= 2  # the micro-batch loop and the layer scan exist


def test_the_layer_scan_keeps_no_returned_rows_at_ep4():
    """scripts/scan_stacks.py (issue 35 item 5): under save_exchange with push at EP 4, the forward scan stacks
    one [rows, D] buffer per layer, the receive buffer (the experts' input). The rows returned to the sources
    are not kept: the routing weights travel with the rows (one float each, the f32[512] stack) and are folded
    into the expert activation, so the combine is a plain sum with nothing to keep. Before, a second [T*K, D]
    stack held the returned rows (f32[128,64] here; 11 GB per micro-batch for the Small at 28 layers), each
    copied into its stack on the GPU."""
    import os
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "scripts/scan_stacks.py"], cwd=repo, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `")]
    wide = [row for row in rows if re.match(r"\| `f32\[\d+,64\]` \|", row)]
    assert len(wide) == 1 and "experts/scatter" in wide[0] and "| 1 |" in wide[0], proc.stdout
    assert any(row.startswith("| `f32[512]` |") for row in rows), proc.stdout  # the received weights
