"""Input data: tokenizers, datasets, packing and the grain pipeline.

pipeline.py     make_input (training stream), make_eval_input (fixed eval batches)
sources.py      one SourceConfig -> checked, random-access windows (kind detection)
windows.py      token streams and their seq_len + 1 windows; synthetic windows
documents.py    raw documents: .txt / .jsonl / .parquet files, HuggingFace datasets
tokenizer.py    bytes, tokenizers JSON, sentencepiece, transformers directories
arrayrecord.py  pre-tokenized shards (what xmoe-tokenize writes)
megatron.py     Megatron .bin/.idx (read with numpy memory maps; a small writer)
tokenize.py     xmoe-tokenize: documents -> ArrayRecord shards, resumable
fingerprint.py  what a data position indexes into: checked on --resume and by xmoe-tokenize
provenance.py   which tokenizer a dataset and a run were made with
"""

from xmoe_jax.data.pipeline import make_eval_input, make_input
from xmoe_jax.data.tokenizer import BYTES_EOS, BYTES_VOCAB, Tokenizer, load_tokenizer
from xmoe_jax.data.windows import SYNTHETIC_STRIDES

TEXT_VOCAB = BYTES_VOCAB  # byte-level ids 0..255 (the name earlier versions exported)

__all__ = [
    "BYTES_EOS",
    "BYTES_VOCAB",
    "SYNTHETIC_STRIDES",
    "TEXT_VOCAB",
    "Tokenizer",
    "load_tokenizer",
    "make_eval_input",
    "make_input",
]
