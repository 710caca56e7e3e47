"""HuggingFace conversion without torch: refusals, round trips, placement (the README's commands:
tests/test_readme_walkthrough.py).

The checks against `transformers` itself are in test_hf.py (skipped without the `hf` extra).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import numpy as np
import pytest

from xmoe_jax import sharding
from xmoe_jax.config import (
    Config,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
    TrainConfig,
    load_config,
    to_dict,
)
from xmoe_jax.data import load_tokenizer
from xmoe_jax.hf import ADAPTERS, ConversionError
from xmoe_jax.hf import safetensors_io as st
from xmoe_jax.hf.convert import choose_adapter, export_checkpoint, import_checkpoint, import_config
from xmoe_jax.model import functional as fmodel
from xmoe_jax.model import model_spec
from xmoe_jax.train.rundir import RunDir
from xmoe_jax.train.weights import load_weights, save_initial

REPO = pathlib.Path(__file__).resolve().parents[1]

# tiny models of each family, as our configs (vocab >= 256: the README generates bytes from them)
_BASE = dict(
    vocab_size=256, hidden=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32"
)
_MOE = dict(num_experts=8, top_k=2, expert_hidden=16)
MODELS = {
    "mixtral": ModelConfig(**_BASE, num_dense_layers=0, moe=MoEConfig(**_MOE)),
    "qwen2_moe": ModelConfig(
        **_BASE,
        num_dense_layers=1,
        dense_hidden=48,
        qkv_bias=True,
        moe=MoEConfig(
            **_MOE,
            norm_topk_prob=False,
            num_shared_experts=1,
            shared_expert_hidden=24,
            shared_expert_gate=True,
        ),
    ),
    "qwen3_moe": ModelConfig(
        **_BASE, num_dense_layers=0, qk_norm="head", tie_embeddings=True, moe=MoEConfig(**_MOE)
    ),
    "olmoe": ModelConfig(
        **{**_BASE, "head_dim": None}, num_dense_layers=0, qk_norm="full", moe=MoEConfig(**_MOE)
    ),
}
_MLA_BASE = dict(
    vocab_size=256, hidden=32, num_layers=3, num_heads=4, dtype="float32", num_dense_layers=1, dense_hidden=48,
    attention_type="mla",
)  # fmt: skip
MODELS["deepseek_v2"] = ModelConfig(
    **_MLA_BASE,
    mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    rope_scaling=RopeScalingConfig(
        factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707
    ),
    moe=MoEConfig(**_MOE, num_shared_experts=2, norm_topk_prob=False),
)
MODELS["deepseek_v3"] = ModelConfig(  # with a multi-token prediction module
    **_MLA_BASE,
    mla=MLAConfig(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    rope_scaling=RopeScalingConfig(factor=4.0, original_max_position_embeddings=64),
    mtp_depth=1,
    moe=MoEConfig(
        **_MOE,
        num_shared_experts=1,
        score_func="sigmoid",
        num_groups=2,
        topk_groups=1,
        routed_scaling_factor=2.5,
    ),
)


def _run(model: ModelConfig, run_dir: pathlib.Path) -> Config:
    """A run directory holding `model` with random weights (numpy: nothing to compile)."""
    cfg = Config(model=model, train=TrainConfig(run_dir=str(run_dir), seq_len=16, batch_size=8))
    mesh = sharding.make_mesh(cfg.mesh)
    spec = model_spec(model)
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        weights = jax.tree.map(
            lambda x, where: jax.device_put((0.2 * rng.normal(size=x.shape)).astype(x.dtype), where),
            (spec.params_shape, spec.bias_shape),
            fmodel.shardings(spec, mesh),
        )
        save_initial(cfg, weights, mesh)
    return cfg


def _weights(run_dir, *overrides):
    cfg, step = RunDir(run_dir).config_at(None, list(overrides))
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        return load_weights(run_dir, cfg, step, mesh)


def _assert_bitwise(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


SLOW_ARCHS = ("deepseek_v2", "deepseek_v3", "qwen2_moe")


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.slow) if a in SLOW_ARCHS else a for a in sorted(MODELS)]
)  # the default suite keeps mixtral, olmoe and qwen3_moe (10-13 s each); deepseek_v3 (~49 s) and qwen2_moe (~27 s) are slow
def test_export_then_import_is_bitwise(arch: str, tmp_path) -> None:
    _run(MODELS[arch], tmp_path / "run")
    assert choose_adapter(RunDir(tmp_path / "run").config_at()[0]).model_type == arch
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == arch and hf["architectures"] == [ADAPTERS[arch].architecture]
    cfg = import_checkpoint(tmp_path / "hf", tmp_path / "back")
    names = ("rope_theta", "norm_eps", "qkv_bias", "qk_norm", "tie_embeddings", "num_dense_layers")
    for name in (*names, "attention_type", "mla", "rope_scaling", "mtp_depth"):
        assert getattr(cfg.model, name) == getattr(MODELS[arch], name), name
    assert cfg.model.moe.norm_topk_prob == MODELS[arch].moe.norm_topk_prob
    _assert_bitwise(_weights(tmp_path / "back"), _weights(tmp_path / "run"))


def test_sharded_files_and_fused_experts_import_alike(tmp_path) -> None:
    _run(MODELS["qwen3_moe"], tmp_path / "run")
    files = export_checkpoint(tmp_path / "run", tmp_path / "hf", max_shard_bytes=20_000)
    assert len(files) > 1 and (tmp_path / "hf" / st.INDEX).is_file()
    # the run's tokenizer (bytes) goes along as an equivalent byte-level tokenizer.json
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    exported, text = load_tokenizer(str(tmp_path / "hf")), ["ROMEO: héllo\n\tx"]
    assert exported.encode_batch(text) == load_tokenizer("bytes").encode_batch(text)
    assert exported.eos_id == 0 and exported.decode(exported.encode_batch(text)[0]) == text[0]
    # the same tensors with each layer's experts fused, as recent transformers keeps them in memory
    reader, fused = st.Reader(tmp_path / "hf"), {}
    for key in sorted(reader.keys()):
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", key)
        if m is None:
            fused[key] = reader.read(key)
        elif m[2] == "0":
            stack = [reader.read(f"{m[1]}.{e}.{m[3]}_proj.weight") for e in range(8)]
            if m[3] == "down":
                fused[f"{m[1]}.down_proj"] = np.stack(stack)
            elif m[3] == "gate":
                ups = [reader.read(f"{m[1]}.{e}.up_proj.weight") for e in range(8)]
                fused[f"{m[1]}.gate_up_proj"] = np.stack(
                    [np.concatenate(p) for p in zip(stack, ups, strict=True)]
                )
    (tmp_path / "fused").mkdir()
    st.write_sharded(fused.items(), tmp_path / "fused")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    imported = import_checkpoint(tmp_path / "hf", tmp_path / "a")  # with the export's tokenizer
    assert imported.data.tokenizer == str(tmp_path / "a" / "tokenizer")
    assert (tmp_path / "a" / "tokenizer" / "tokenizer.json").is_file()
    assert import_checkpoint(tmp_path / "fused", tmp_path / "b").data.tokenizer == "auto"  # none there
    _assert_bitwise(_weights(tmp_path / "a"), _weights(tmp_path / "b"))


def test_import_places_experts_by_the_mesh_and_reads_each_once(tmp_path, monkeypatch) -> None:
    _run(MODELS["mixtral"], tmp_path / "run")
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    reads: list[str] = []
    original = st.Reader.read
    monkeypatch.setattr(
        st.Reader, "read", lambda self, key, index=(): reads.append(key) or original(self, key, index)
    )
    import_checkpoint(tmp_path / "hf", tmp_path / "ep", ["mesh.data=2", "mesh.expert=4"])
    expert_reads = [k for k in reads if ".experts." in k]
    assert sorted(expert_reads) == sorted(set(expert_reads))  # every expert tensor read once, by its shard
    assert len(expert_reads) == 3 * 3 * 8  # layers x (w1, w2, w3) x experts
    params, _ = _weights(tmp_path / "ep")
    w_gate = params["moe_layers"]["moe"]["experts"]["w_gate"]  # [L, E, D, F]
    assert w_gate.sharding.spec[1] == sharding.EXPERT_AXES
    want = np.asarray(_weights(tmp_path / "run")[0]["moe_layers"]["moe"]["experts"]["w_gate"])
    for shard in w_gate.addressable_shards:
        assert shard.data.shape[1] == 2  # 8 experts over 4 devices
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def _hf(model_type: str, **changes) -> dict:
    hf = {"model_type": model_type, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2}
    hf.update(num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, moe_intermediate_size=16)
    hf.update(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=20)
    return {**hf, **changes}


def _deepseek(version: str, **changes) -> dict:
    hf = {"model_type": f"deepseek_{version}", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3}
    hf.update(num_attention_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8)
    hf.update(num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16)
    hf.update(q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    return {**hf, **changes}


def test_deepseek_config_keys_map_to_ours(tmp_path) -> None:
    """DeepSeek-V3 as its release writes config.json (rope_scaling and rope_theta, not
    rope_parameters); MTP modules come from the files, not num_nextn_predict_layers."""
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32}
    hf = _deepseek("v3", q_lora_rank=12, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_theta=5e4)
    hf.update(
        rope_scaling={**yarn, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        num_nextn_predict_layers=1,
    )
    model = import_config(hf, tmp_path).model
    assert (model.attention_type, model.mla.q_lora_rank, model.mla.rope_interleave) == ("mla", 12, True)
    assert (
        model.rope_theta == 5e4
        and model.rope_scaling.factor == 40
        and model.rope_scaling.mscale_all_dim == 1.0
    )
    assert (model.moe.num_groups, model.moe.topk_groups, model.moe.routed_scaling_factor) == (2, 1, 2.5)
    assert model.moe.score_func == "sigmoid" and model.mtp_depth == 0
    with_mtp = import_config(hf, tmp_path, tensor_keys={"model.layers.3.eh_proj.weight"}).model
    assert with_mtp.mtp_depth == 1
    # mscale keys absent read as 0 (transformers: cos/sin by mscale(factor), softmax scale untouched)
    bare = import_config(_deepseek("v2", rope_scaling=yarn), tmp_path).model.rope_scaling
    assert bare.mscale == bare.mscale_all_dim == 0.0


@pytest.mark.parametrize(
    "hf, match",
    [
        (_hf("llama"), "no adapter"),
        (_hf("mixtral", rope_scaling={"type": "yarn", "factor": 4}), "RoPE scaling 'yarn'"),
        (_hf("qwen3_moe", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "'dynamic'"),
        (_hf("mixtral", sliding_window=4096), "sliding_window"),
        (_hf("qwen2_moe", use_sliding_window=True), "use_sliding_window"),
        (_hf("qwen2_moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
        (_hf("qwen3_moe", mlp_only_layers=[1]), "mlp_only_layers"),
        (_hf("qwen3_moe", attention_bias=True), "attention_bias"),
        (_hf("olmoe", clip_qkv=8.0), "clip_qkv"),
        (_hf("olmoe", hidden_act="gelu"), "hidden_act"),
        (_hf("mixtral", num_experts_per_tok=8), "top_k=8"),
        (_hf("mixtral", rope_scaling={"type": "yarn", "factor": 4}), "YaRN for DeepSeek-V2/V3 only"),
        (_deepseek("v3", quantization_config={"quant_method": "fp8"}), "quantized .fp8.; dequantize"),
        (_deepseek("v2", topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
        (_deepseek("v2", norm_topk_prob=True), "norm_topk_prob=true"),
        (_deepseek("v3", moe_layer_freq=2), "moe_layer_freq=2"),
        (_deepseek("v3", num_key_value_heads=2), "num_key_value_heads"),
        (_deepseek("v3", rope_scaling={"type": "dynamic", "factor": 2.0}), "'dynamic'"),
        (_deepseek("v3", n_shared_experts=0), "n_shared_experts"),
    ],
)
def test_unsupported_configs_are_refused_by_name(hf: dict, match: str, tmp_path) -> None:
    with pytest.raises(ConversionError, match=match):
        import_config(hf, tmp_path)


def test_dense_first_layers_map_to_num_dense_layers(tmp_path) -> None:
    cfg = import_config(_hf("qwen2_moe", mlp_only_layers=[0], qkv_bias=False), tmp_path)
    assert cfg.model.num_dense_layers == 1 and cfg.model.dense_hidden == 24 and not cfg.model.qkv_bias
    assert cfg.train.run_dir == str(tmp_path)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_import_writes_the_product_dispatch(arch: str, tmp_path) -> None:
    """Issue 37 section 1: an imported config.yaml said `dispatch: dense` (every expert on every
    token); it now says pft, the padding-free dropless path."""
    cfg = import_config(_hf(arch), tmp_path)
    assert cfg.parallel.dispatch == "pft" and to_dict(cfg)["parallel"]["dispatch"] == "pft"


def test_export_of_an_unrepresentable_model_names_each_reason() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")  # ungated shared expert, dense layer, no q/k norm
    with pytest.raises(
        ConversionError, match=r"nearest.*qwen2_moe: .*gated.* mixtral: .*dense layers"
    ) as err:
        choose_adapter(cfg)
    assert len(str(err.value)) < 400 and "configs/tiny_hf.yaml" in str(err.value)  # was 783 characters
    with pytest.raises(ConversionError, match=r"--arch olmoe cannot hold this model: .*full-width"):
        choose_adapter(cfg, "olmoe")
    assert choose_adapter(load_config(REPO / "configs" / "tiny_hf.yaml")).model_type == "qwen2_moe"
    sigmoid = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, score_func="sigmoid"))
    with pytest.raises(ConversionError, match="softmax"):
        choose_adapter(dataclasses.replace(cfg, model=sigmoid), "qwen3_moe")
