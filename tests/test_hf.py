"""HuggingFace conversion against `transformers` itself (tested with transformers 5.23, torch 2.14).

Tiny random models are built with `transformers` from configs made here (no download), saved
with `save_pretrained`, imported, and our logits must equal theirs on the same tokens (float32);
our export must load in `transformers` and give the same logits, its tensors bitwise the source's.
DeepSeek-V3's multi-token prediction module, which `save_pretrained` does not hold, is checked
through our export against transformers' MtpModel.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from reference import rel_err

torch = pytest.importorskip("torch", reason="needs the hf extra (pip install -e '.[hf]'): torch")
transformers = pytest.importorskip("transformers", reason="needs the hf extra (pip install -e '.[hf]')")

import jax  # noqa: E402

from xmoe_jax import sharding  # noqa: E402
from xmoe_jax.cli_models import convert_main  # noqa: E402
from xmoe_jax.hf.safetensors_io import Reader  # noqa: E402
from xmoe_jax.model import functional as fmodel  # noqa: E402
from xmoe_jax.train.rundir import RunDir  # noqa: E402
from xmoe_jax.train.weights import load_weights  # noqa: E402

_COMMON = dict(
    vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2
)
CASES = {
    # every layer MoE, plain attention
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, rope_theta=1e4
    ),
    # q/k/v bias, gated shared expert, a dense first layer, no top-k renormalisation
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON,
        num_hidden_layers=3,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_experts=4,
        shared_expert_intermediate_size=20,
        mlp_only_layers=[0],
    ),
    # per-head q/k norm, head_dim != hidden / heads, tied embeddings, renormalised top-k
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        num_hidden_layers=2,
        intermediate_size=24,
        moe_intermediate_size=16,
        num_experts=4,
        head_dim=12,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
    # full-width q/k norm
    "olmoe": lambda: transformers.OlmoeConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, num_experts=4, eos_token_id=1, pad_token_id=0
    ),
}
_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)
_MLA = dict(
    vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
    num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
    first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    max_position_embeddings=256,
)  # fmt: skip
CASES.update(
    {
        # MLA without a query latent, interleaved RoPE, YaRN with mscale 0.707, 2 shared experts,
        # softmax top-k without renormalisation (DeepSeek-V2-Lite's shape)
        "deepseek_v2": lambda: transformers.DeepseekV2Config(
            **_MLA,
            q_lora_rank=None,
            n_shared_experts=2,
            rope_scaling={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        ),
        # query latent, sigmoid routing in 2 groups (1 kept) with a correction bias, scaled weights
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **_MLA,
            q_lora_rank=12,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            rope_scaling={**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
        ),
        # rotate-half RoPE without scaling, no groups, tied embeddings
        "deepseek_v3_plain": lambda: transformers.DeepseekV3Config(
            **_MLA,
            q_lora_rank=12,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    }
)
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 12))
REPO = pathlib.Path(__file__).resolve().parents[1]


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(arch, HF model, its directory, our run directory imported onto an expert-parallel mesh)."""
    arch = request.param
    torch.manual_seed(0)
    config = CASES[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # every weight random, norm scales around one, biases off zero
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's routing correction bias
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    root = tmp_path_factory.mktemp(arch)
    model.save_pretrained(root / "hf")
    argv = ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "run"), "--set", "mesh.expert=4"]
    assert convert_main(argv) == 0
    return arch, model, root


def test_imported_logits_match_transformers(converted) -> None:
    arch, model, root = converted
    cfg, step = RunDir(root / "run").config_at(None, ["model.dtype=float32"])
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        params, bias = load_weights(root / "run", cfg, step, mesh)
        spec = fmodel.model_spec(cfg.model, cfg.parallel)
        logits, _ = jax.jit(lambda p, b, t: fmodel.apply(spec, p, b, t))(params, bias, TOKENS)
    want = _hf_logits(model, TOKENS)
    assert rel_err(logits, want) < 1e-5, arch
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4)


def test_export_loads_in_transformers_bitwise(converted) -> None:
    arch, model, root = converted
    assert convert_main(["export", "--run-dir", str(root / "run"), "--out", str(root / "out")]) == 0
    ours, source = Reader(root / "out"), Reader(root / "hf")
    assert ours.keys() == source.keys()
    for key in sorted(source.keys()):
        np.testing.assert_array_equal(ours.read(key), source.read(key), err_msg=key)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        root / "out", attn_implementation="eager"
    ).eval()
    assert type(loaded) is type(model)
    np.testing.assert_array_equal(_hf_logits(loaded, TOKENS), _hf_logits(model, TOKENS))


@pytest.mark.parametrize("converted", ["qwen2_moe"], indirect=True)  # one is enough for these options
def test_bfloat16_sharded_export_loads(converted, tmp_path) -> None:
    _, model, root = converted
    argv = ["export", "--run-dir", str(root / "run"), "--out", str(tmp_path), "--dtype", "bfloat16"]
    assert convert_main([*argv, "--max-shard-size", "0.02MB"]) == 0
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert rel_err(_hf_logits(loaded, TOKENS), _hf_logits(model, TOKENS)) < 0.05  # bf16 weights


@pytest.mark.slow  # ~25 s
def test_deepseek_v3_mtp_module_matches_transformers_mtp_model(tmp_path) -> None:
    """Our MTP module (configs/tiny_deepseek.yaml, random weights) exported as DeepSeek's layer L
    loads in transformers' MtpModel; its logits for the next-next token equal ours."""
    from flax import nnx
    from test_hf_convert import _run
    from transformers.modeling_layers import MtpModel

    from xmoe_jax.config import load_config
    from xmoe_jax.hf.convert import export_checkpoint

    model_cfg = load_config(REPO / "configs" / "tiny_deepseek.yaml", ["model.dtype=float32"]).model
    _run(model_cfg, tmp_path / "run")
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    main = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    # transformers finds MTP tensors by the pattern DeepSeek-V3's 61 layers register (model.layers.61)
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model_cfg.num_layers}.*"]
    mtp = MtpModel.from_pretrained(main).eval()
    tokens, following = (np.random.default_rng(i).integers(0, 256, (2, 10)) for i in (0, 1))
    with torch.no_grad():
        h = main(torch.tensor(tokens), output_hidden_states=True).hidden_states[-1]  # final-normed
        positions = torch.arange(10)[None].expand(2, -1)
        want = mtp._project_to_logits(
            mtp.forward_layer(0, h, positions, None, input_ids=torch.tensor(following))
        )
    cfg, step = RunDir(tmp_path / "run").config_at(None, [])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh):
        params, bias = load_weights(tmp_path / "run", cfg, step, mesh)
    ours = nnx.merge(fmodel.model_spec(cfg.model).graphdef, params, bias)
    h_ours, _ = ours(tokens)
    graphdef, state = nnx.split(ours.mtp_layers)
    module = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    out, _ = module(h_ours, jax.numpy.take(params["embed"], following, axis=0))
    assert rel_err(ours.logits(out), want.numpy()) < 1e-5


def test_exported_tokenizers_load_in_transformers(tmp_path) -> None:
    """Export writes the run's tokenizer so `AutoTokenizer.from_pretrained` gives the ids the model
    was trained on: `bytes` as a byte-level tokenizer.json, a tokenizers JSON with its eos named."""
    from data_helpers import documents, train_bpe

    from xmoe_jax.data import load_tokenizer
    from xmoe_jax.hf.tokenizer import export_tokenizer

    text = "ROMEO: héllo\n\tthe king"
    (tmp_path / "bytes").mkdir()
    assert export_tokenizer(RunDir(tmp_path / "run").tokenizer, "bytes", tmp_path / "bytes") == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bytes"))
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode()) and tok.eos_token_id == 0
    assert tok.decode(list(text.encode())) == text
    bpe = train_bpe(documents(300), tmp_path / "bpe.json", vocab_size=300)
    (tmp_path / "bpe").mkdir()
    export_tokenizer(RunDir(tmp_path / "run").tokenizer, str(bpe), tmp_path / "bpe")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    ours = load_tokenizer(str(bpe))
    assert tok(text, add_special_tokens=False)["input_ids"] == ours.encode_batch([text])[0]
    assert tok.eos_token_id == ours.eos_id
