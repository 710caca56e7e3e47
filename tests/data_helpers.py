"""Small corpora and tokenizers made inside the tests (no downloads), shared by the data tests.

`documents(n)` is a deterministic list of short English-like documents; `write_corpus(root)`
stores the same documents in every format the trainer reads and returns where each one is, with
the byte-level token stream (`bytes` tokenizer: UTF-8 bytes, each document followed by eos 0)
every source must reproduce.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

WORDS = "the a king queen fool speaks loves fears crown night day sword song river old young wise".split()
# the text shipped in the repository (data/README.md): every test that reads text can rely on it
SHARED_TEXT = pathlib.Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"


def documents(num: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        words = rng.choice(WORDS, size=int(rng.integers(3, 12)))
        out.append(f"{i}: " + " ".join(words).capitalize() + ".")
    return out


def byte_stream(docs: list[str]) -> np.ndarray:
    """What the `bytes` tokenizer packs: each document's UTF-8 bytes, then eos 0."""
    chunks = [np.frombuffer(d.encode() + b"\x00", dtype=np.uint8) for d in docs]
    return np.concatenate(chunks).astype(np.int32)


def write_jsonl(path: pathlib.Path, docs: list[str], field: str = "text") -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: pathlib.Path, docs: list[str], field: str = "text") -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: docs}), path)
    return path


def write_corpus(root: pathlib.Path, docs: list[str]) -> dict[str, str]:
    """Every format holding `docs` in order, for the byte tokenizer; returns kind -> path."""
    import datasets

    from xmoe_jax.data.megatron import write_megatron
    from xmoe_jax.data.tokenize import tokenize_to_shards

    half = len(docs) // 2
    write_jsonl(root / "jsonl" / "part-0.jsonl", docs[:half])
    write_jsonl(root / "jsonl" / "part-1.jsonl", docs[half:])
    write_parquet(root / "parquet" / "all.parquet", docs, field="body")
    (root / "txt").mkdir()
    for i, d in enumerate(docs):
        (root / "txt" / f"doc-{i:04d}.txt").write_text(d)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "hf"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": docs}),
            "test": datasets.Dataset.from_dict({"text": ["x"]}),
        }
    ).save_to_disk(str(root / "hf_dict"))
    arrow = next((root / "hf").glob("*.arrow"))
    (root / "arrow").mkdir()
    os.link(arrow, root / "arrow" / arrow.name)
    tokenize_to_shards(str(root / "jsonl"), "bytes", root / "shards", shard_tokens=500)
    (root / "megatron").mkdir()
    write_megatron(root / "megatron" / "corpus_text_document", [byte_stream([d]) for d in docs])
    return {
        "jsonl": str(root / "jsonl" / "*.jsonl"),
        "parquet": str(root / "parquet"),
        "txt": str(root / "txt"),
        "hf": str(root / "hf"),
        "hf_dict": str(root / "hf_dict"),
        "arrow": str(root / "arrow"),
        "arrayrecord": str(root / "shards"),
        "megatron": str(root / "megatron" / "corpus_text_document"),
    }


def train_bpe(texts: list[str], path: pathlib.Path, vocab_size: int = 300) -> pathlib.Path:
    """A byte-level BPE tokenizer.json trained with `tokenizers` (eos: <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
