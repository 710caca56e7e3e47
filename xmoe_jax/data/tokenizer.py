"""Tokenizers: `data.tokenizer` names one, and this module loads it with its own library.

Why a thin wrapper: the pipeline needs four things from any tokenizer (batch encoding, decoding,
the vocabulary size the model must cover, and the end-of-document id that packing puts after
every document), and each library spells them differently. Nothing here tokenizes by itself.

`data.tokenizer` is one of (`load_tokenizer` decides, in this order):
  1. `bytes` (and `auto` where nothing resolved it: `provenance.py`): UTF-8 bytes, ids 0..255. The end-of-document id is 0 (NUL, which text does not
     hold), so a byte-level model keeps vocab_size 256;
  2. a `*.json` file: a HuggingFace `tokenizers` tokenizer (tokenizer.json);
  3. a `*.model` file: a sentencepiece model;
  4. a directory with tokenizer.json (a `transformers` tokenizer directory, read with
     `tokenizers`; its tokenizer_config.json names the eos token), or with a sentencepiece
     tokenizer.model / spiece.model;
  5. any other directory: `transformers.AutoTokenizer` (optional; not installed by xmoe_jax).
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Protocol

from xmoe_jax.config import ConfigError

BYTES_VOCAB = 256
BYTES_EOS = 0  # NUL: never in text, so the byte vocabulary needs no extra id
# eos spellings tried, in order, when a tokenizer.json comes without a tokenizer_config.json
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[EOS]", "<EOS>")


class Tokenizer(Protocol):
    name: str  # what data.tokenizer said
    vocab_size: int  # ids are in [0, vocab_size)
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class BytesTokenizer:
    """UTF-8 bytes as ids; decoding replaces invalid sequences."""

    name = "bytes"
    vocab_size = BYTES_VOCAB
    eos_id = BYTES_EOS

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Ids past 255 (a model with a larger vocabulary) decode as U+FFFD, like invalid bytes."""
        out = b"".join(bytes([i]) if 0 <= i < BYTES_VOCAB else b"\xef\xbf\xbd" for i in map(int, ids))
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; special tokens are not added on encoding
    (packing adds the eos itself)."""

    def __init__(self, name: str, path: pathlib.Path, eos_token: str | None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise ConfigError(f"data.tokenizer={name!r}: {path} is not a tokenizers JSON file ({e})") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.name = name
        self.vocab_size = max(vocab.values()) + 1
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        found = [vocab[t] for t in candidates if t in vocab]
        if not found:
            raise ConfigError(
                f"data.tokenizer={name!r} has no end-of-document token (looked for {list(candidates)}); "
                "add one to the tokenizer, or name it as eos_token in a tokenizer_config.json beside "
                "tokenizer.json and pass the directory"
            )
        self.eos_id = found[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer:
    """A sentencepiece model; its eos piece ends documents."""

    def __init__(self, name: str, path: pathlib.Path) -> None:
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # OSError or RuntimeError depending on the version
            raise ConfigError(f"data.tokenizer={name!r}: {path} is not a sentencepiece model ({e})") from e
        self.name = name
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise ConfigError(
                f"data.tokenizer={name!r} has no eos piece (trained with eos_id=-1); retrain it with an "
                "eos id or use a tokenizer that has one"
            )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class TransformersTokenizer:
    """`transformers.AutoTokenizer` from a local directory (no download)."""

    def __init__(self, name: str, path: pathlib.Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ConfigError(
                f"data.tokenizer={name!r} is a directory without tokenizer.json or a sentencepiece model; "
                "reading it needs transformers (pip install transformers), or save its tokenizer.json there"
            ) from e
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.name = name
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise ConfigError(f"data.tokenizer={name!r} has no eos token; set eos_token in its config")
        self.eos_id = int(self._tok.eos_token_id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def _config_eos(directory: pathlib.Path) -> str | None:
    """The eos token named by a transformers tokenizer_config.json (a string or {"content": ...})."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is damaged ({e.msg}: line {e.lineno} column {e.colno})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    return eos.get("content") if isinstance(eos, dict) else eos


@functools.lru_cache(maxsize=8)
def _load(name: str, mtime_ns: int) -> Tokenizer:
    del mtime_ns  # part of the cache key only: a rewritten file is read again
    path = pathlib.Path(name)
    if path.is_file():
        if path.suffix == ".json":
            return HFTokenizer(name, path, _config_eos(path.parent))
        if path.suffix == ".model":
            return SentencePieceTokenizer(name, path)
        raise ConfigError(
            f"data.tokenizer={name!r}: unknown tokenizer file type {path.suffix!r}; give a tokenizer.json, "
            "a sentencepiece .model or a tokenizer directory"
        )
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(name, path / "tokenizer.json", _config_eos(path))
    for model in ("tokenizer.model", "spiece.model"):
        if (path / model).is_file():
            return SentencePieceTokenizer(name, path / model)
    return TransformersTokenizer(name, path)


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer `data.tokenizer` names (cached per file version); `ConfigError` if it cannot
    be found or read."""
    if name in ("bytes", "auto"):
        return BytesTokenizer()
    path = pathlib.Path(name)
    if not path.exists():
        raise ConfigError(
            f"data.tokenizer={name!r} does not exist; set it to 'bytes', a tokenizer.json, a sentencepiece "
            ".model or a tokenizer directory"
        )
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    return _load(name, max((p.stat().st_mtime_ns for p in files), default=0))


def check_vocab(tokenizer_vocab: int, model_vocab: int, what: str) -> None:
    """The model's embedding must cover every id the data can hold."""
    if model_vocab < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the vocabulary of {what} "
            f"({tokenizer_vocab} ids); set model.vocab_size >= {tokenizer_vocab}"
        )
