"""A HuggingFace `config.json`, read and checked before an adapter reads its fields.

Why: the adapters read fields as `int(hf["hidden_size"])`. A damaged file, a list where the object
belongs, a missing field, or a list or string where a number belongs used to end in a traceback or in
a message that named neither the file nor the field. Here, in order:
  1. the file exists and parses (else its line and column), and holds a JSON object;
  2. every field an adapter reads as a number, flag, name, list or object has that kind
     (`null` stands for "not set" everywhere, as transformers writes it), numbers are finite;
  3. the result is a `Fields`: a required field read with `hf["name"]` that is missing or null is
     a `ConversionError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from xmoe_jax.hf.mapping import ConversionError

# the fields the adapters read (xmoe_jax/hf/*.py), by kind; a new adapter adds its own here
INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "intermediate_size", "moe_intermediate_size", "num_experts",
    "num_local_experts", "num_experts_per_tok", "shared_expert_intermediate_size", "decoder_sparse_step",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "first_k_dense_replace", "n_shared_experts", "n_routed_experts", "moe_layer_freq", "n_group",
    "topk_group", "num_nextn_predict_layers", "num_mtp_layers", "original_max_position_embeddings",
)  # fmt: skip
FLOATS = (
    "rope_theta", "rms_norm_eps", "initializer_range", "router_aux_loss_coef", "routed_scaling_factor",
    "aux_loss_alpha", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
)  # fmt: skip
BOOLS = (
    "tie_word_embeddings", "norm_topk_prob", "qkv_bias", "use_sliding_window", "attention_bias", "mlp_bias",
    "seq_aux", "rope_interleave", "truncate",
)  # fmt: skip
STRS = ("model_type", "hidden_act", "topk_method", "scoring_func", "rope_type", "type")
LISTS = ("layer_types", "mlp_only_layers")
OBJECTS = ("rope_scaling", "rope_parameters", "quantization_config")
ROPE_OBJECTS = ("rope_scaling", "rope_parameters")  # their fields are checked by the same tables


class Fields(dict):
    """config.json's object. `hf["name"]` (a required field) names the file and the field when
    it is missing or null; `hf.get` works as on a dict."""

    source: str = "config.json"

    def __getitem__(self, key: str):
        value = super().get(key)
        if value is None:
            state = "is missing" if key not in self else "is null"
            raise ConversionError(
                f"{self.source}: field {key!r} {state}; a {self.get('model_type')} config needs it (compare "
                "with the model's published config.json)"
            )
        return value


def _kind_error(source: str, name: str, value, want: str) -> ConversionError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ConversionError(f"{source}: field {name!r} is {shown}; it must be {want}")


def _check_value(source: str, name: str, key: str, value) -> None:
    if value is None:
        return
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if key in INTS and not (is_number and float(value).is_integer()):
        raise _kind_error(source, name, value, "a whole number")
    if key in FLOATS and not (is_number and math.isfinite(value)):
        raise _kind_error(source, name, value, "a finite number")
    if key in BOOLS and not isinstance(value, bool):
        raise _kind_error(source, name, value, "true or false")
    if key in STRS and not isinstance(value, str):
        raise _kind_error(source, name, value, "a string")
    if key in LISTS and not isinstance(value, list):
        raise _kind_error(source, name, value, "a list")
    if key == "mlp_only_layers" and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _kind_error(source, name, value, "a list of layer numbers")
    if key in OBJECTS and not isinstance(value, dict):
        raise _kind_error(source, name, value, "an object ({...})")


def check(hf: object, source: str = "config.json") -> Fields:
    """Steps 1-3 of the module docstring for an already parsed `hf`; `source` names it in errors."""
    if not isinstance(hf, dict):
        raise ConversionError(
            f"{source} holds a JSON {type(hf).__name__}, not an object; a HuggingFace config.json is one "
            '{"model_type": ..., "hidden_size": ..., ...}'
        )
    for key, value in hf.items():
        _check_value(source, key, key, value)
        if key in ROPE_OBJECTS and value is not None:
            for sub, v in value.items():
                _check_value(source, f"{key}.{sub}", sub, v)
    fields = Fields(hf)
    fields.source = source
    return fields


def read(hf_dir: str | Path) -> Fields:
    """`<hf_dir>/config.json`, checked (the module docstring)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        what = "does not exist" if not Path(hf_dir).exists() else "has no config.json"
        raise ConversionError(f"--hf-dir {hf_dir} {what}; pass a HuggingFace model directory")
    try:
        hf = json.loads(path.read_text())
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path} is not UTF-8 text ({e.reason}); download it again") from None
    except json.JSONDecodeError as e:
        raise ConversionError(
            f"{path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}); the file is damaged or "
            "cut short: download it again"
        ) from None
    return check(hf, str(path))
