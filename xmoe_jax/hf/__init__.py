"""HuggingFace checkpoints in and out: a table of per-architecture adapters.

    xmoe-convert import --hf-dir DIR --out RUN_DIR     # safetensors + config.json -> a run to resume
    xmoe-convert export --run-dir RUN_DIR --out DIR    # a run's checkpoint -> safetensors + config.json

One module per family (mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py, deepseek.py: V2 and V3; torchtitan's
"state-dict adapter" pattern), each an `Adapter` (adapter.py): config.json <-> ModelConfig and
a tensor table (mapping.py). A new family is a new module and one line in `ADAPTERS`. Around them:
convert.py (import and export), config_json.py (config.json checked field by field), export_dir.py
(the output folder: staged, never mixed), tokenizer.py (the run's tokenizer in an export). Nothing
here imports torch or transformers: tensors go through `safetensors`' numpy API
(safetensors_io.py). Written for and tested against transformers 5.23.
"""

from xmoe_jax.hf.adapter import Adapter
from xmoe_jax.hf.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from xmoe_jax.hf.mapping import ConversionError
from xmoe_jax.hf.mixtral import MIXTRAL
from xmoe_jax.hf.olmoe import OLMOE
from xmoe_jax.hf.qwen2_moe import QWEN2_MOE
from xmoe_jax.hf.qwen3_moe import QWEN3_MOE

# model_type -> adapter; export tries them in this order when no --arch is given
ADAPTERS: dict[str, Adapter] = {
    a.model_type: a for a in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V2, DEEPSEEK_V3)
}

__all__ = ["ADAPTERS", "Adapter", "ConversionError"]
