"""Opening one `SourceConfig` as random-access windows, with every check made before training.

Why a table of openers: each kind of dataset has one function that turns it into a token stream
(`windows.TokenStream`) and checks it (exists, not empty, ids fit the model); packing, slicing,
shuffling and mixing are then the same for all (`pipeline.py`).

Kinds (`source`; `auto` detects them from `path`):
  synthetic    arithmetic progressions, no files;
  text         one file as one stream, no end-of-document marks (`bytes`: the file's bytes,
               memory-mapped, as before tokenizers existed);
  files        .txt / .jsonl / .parquet documents (`documents.py`), each followed by eos;
  hf           a `datasets` directory or .arrow files, each row followed by eos;
  arrayrecord  shards written by `xmoe-tokenize` (eos already stored);
  megatron     a .bin/.idx pair (eos as Megatron's preprocessing stored it).
`text`, `files` and `hf` are tokenized at start-up in memory (cached per file version within a
process): fine for corpora of some hundred MB; larger ones go through `xmoe-tokenize` once.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from xmoe_jax.config import ConfigError, SourceConfig
from xmoe_jax.data import documents, megatron
from xmoe_jax.data.arrayrecord import ArrayRecordStream, is_arrayrecord_dir
from xmoe_jax.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from xmoe_jax.data.windows import ArrayStream, PackedWindows, SyntheticWindows, TokenStream

log = logging.getLogger("xmoe_jax")
ENCODE_BATCH = 256  # documents per tokenizer call
_SCAN_TOKENS = 1 << 20  # pre-tokenized ids checked against the model's vocabulary up front


def detect_kind(src: SourceConfig, prefix: str) -> str:
    """`src.source`, or for `auto` the kind its path holds."""
    if src.source != "auto":
        return src.source
    if src.path is None:
        return "synthetic"
    path = pathlib.Path(src.path)
    if is_arrayrecord_dir(src.path):
        return "arrayrecord"
    if megatron.is_megatron(src.path):
        return "megatron"
    hf_dir = path.is_dir() and (
        any((path / n).is_file() for n in ("state.json", "dataset_dict.json")) or any(path.glob("*.arrow"))
    )
    if hf_dir or src.path.endswith(".arrow"):
        return "hf"
    if path.exists() or documents.is_glob(src.path):
        return "files"
    raise ConfigError(
        f"{prefix}path={src.path!r} does not exist; set it to your data (a file, folder or glob of "
        ".txt/.jsonl/.parquet, a datasets directory, xmoe-tokenize output or a Megatron prefix)"
    )


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of `size` consecutive items (the last may be shorter)."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_documents(docs: Iterable[str], tokenizer: Tokenizer, append_eos: bool = True) -> np.ndarray:
    """Concatenated token ids of `docs`, each followed by the tokenizer's eos if `append_eos`."""
    eos = [tokenizer.eos_id] if append_eos else []
    chunks = [
        np.asarray(ids + eos, dtype=np.int32)
        for batch in batched(docs, ENCODE_BATCH)
        for ids in tokenizer.encode_batch(batch)
    ]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int32)


def _signature(paths: Iterable[pathlib.Path]) -> tuple:
    """Names, sizes and mtimes: a cache key that changes when any file does."""
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


_CACHE: dict[tuple, np.ndarray] = {}  # (kind, path, field, split, tokenizer, file signature) -> tokens
_CACHE_ENTRIES = 8


def _tokenized(
    kind: str, src: SourceConfig, tokenizer_name: str, signature: tuple, prefix: str
) -> np.ndarray:
    """Tokens of a source, computed once per process and file version (train and eval share them)."""
    key = (kind, src.path, src.text_field, src.split, tokenizer_name, signature)
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _tokenize_source(kind, src, tokenizer_name, prefix)
    return _CACHE[key]


def _tokenize_source(kind: str, src: SourceConfig, tokenizer_name: str, prefix: str) -> np.ndarray:
    tokenizer = load_tokenizer(tokenizer_name)
    t0 = time.perf_counter()
    if kind == "text":
        text = pathlib.Path(src.path).read_text(encoding="utf-8", errors="replace")
        tokens = tokenize_documents([text], tokenizer, append_eos=False)
    elif kind == "files":
        files = documents.list_files(src.path, prefix)
        docs = (d for f in files for d in documents.file_documents(f, src.text_field, prefix))
        tokens = tokenize_documents(docs, tokenizer)
    else:
        tokens = tokenize_documents(
            documents.hf_documents(src.path, src.text_field, src.split, prefix), tokenizer
        )
    log.info("tokenized %s (%s): %d tokens in %.1fs", src.path, kind, len(tokens), time.perf_counter() - t0)
    return tokens


def _open_text(src: SourceConfig, tokenizer: Tokenizer, prefix: str) -> TokenStream:
    path = pathlib.Path(src.path)
    try:
        with path.open("rb"):
            pass
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(
            f"{prefix}path={src.path!r} cannot be read ({e.strerror}); set {prefix}path to an existing text file"
        ) from e
    if size == 0:
        raise ConfigError(f"{prefix}path={src.path!r} is empty; point it at a text file with content")
    if tokenizer.name == "bytes":  # the file's bytes are the ids: map it, do not copy it
        return ArrayStream(np.memmap(path, dtype=np.uint8, mode="r"))
    return ArrayStream(_tokenized("text", src, tokenizer.name, _signature([path]), prefix))


def _open_documents(kind: str) -> Callable[[SourceConfig, Tokenizer, str], TokenStream]:
    def open_(src: SourceConfig, tokenizer: Tokenizer, prefix: str) -> TokenStream:
        if kind == "files":
            roots = documents.list_files(src.path, prefix)
        else:
            roots = [pathlib.Path(src.path)] if pathlib.Path(src.path).exists() else []
        tokens = _tokenized(kind, src, tokenizer.name, _signature(roots), prefix)
        if len(tokens) == 0:
            raise ConfigError(
                f"{prefix}path={src.path!r} holds no documents with text in field "
                f"{src.text_field!r}; check the data or set {prefix}text_field"
            )
        return ArrayStream(tokens)

    return open_


def _scan(stream: TokenStream, vocab_size: int, what: str) -> None:
    head = stream.read(0, min(len(stream), _SCAN_TOKENS))
    check_vocab(int(head.max()) + 1, vocab_size, what)


def _open_arrayrecord(src: SourceConfig, prefix: str, vocab_size: int) -> TokenStream:
    stream = ArrayRecordStream(src.path, prefix)
    tok = stream.manifest.get("tokenizer")
    check_vocab(stream.vocab_size, vocab_size, f"{prefix}path={src.path!r} (tokenized with {tok!r})")
    return stream


def _open_megatron(src: SourceConfig, prefix: str, vocab_size: int) -> TokenStream:
    stream = ArrayStream(megatron.MegatronIndex(src.path, prefix).tokens_N)
    _scan(stream, vocab_size, f"{prefix}path={src.path!r} (the largest id of its first tokens)")
    return stream


# kind -> opener: (src, tokenizer, prefix) for text to tokenize; (src, prefix, vocab_size) for ids,
# which these check themselves (no tokenizer: data.tokenizer is not used for them)
_TOKENIZING = {"text": _open_text, "files": _open_documents("files"), "hf": _open_documents("hf")}
_PRETOKENIZED = {"arrayrecord": _open_arrayrecord, "megatron": _open_megatron}


def open_windows(
    src: SourceConfig, tokenizer_name: str, *, seq_len: int, vocab_size: int, seed: int, prefix: str
) -> SyntheticWindows | PackedWindows:
    """The windows of `src` (validated). `ConfigError` names the field and the fix."""
    kind = detect_kind(src, prefix)
    if kind == "synthetic":
        return SyntheticWindows(seq_len, vocab_size, seed)
    if kind in _TOKENIZING:
        tokenizer = load_tokenizer(tokenizer_name)
        check_vocab(tokenizer.vocab_size, vocab_size, f"data.tokenizer={tokenizer_name!r}")
        stream = _TOKENIZING[kind](src, tokenizer, prefix)
    else:
        stream = _PRETOKENIZED[kind](src, prefix, vocab_size)
    return PackedWindows(stream, seq_len, vocab_size, f"{prefix}path={src.path!r}")
