"""Raw documents: a folder or glob of .txt / .jsonl / .parquet files, or a HuggingFace `datasets`
directory, read as a stream of strings.

Why one reader for two users: the trainer tokenizes small corpora at start-up and `xmoe-tokenize`
turns large ones into shards once; both must see the same documents in the same order, so they
share this module. A document is a whole .txt file, one JSON object's `text_field` per .jsonl line,
or one row's `text_field` of a parquet file or a `datasets` table. Empty documents are skipped.
Files are read in sorted path order.
"""

from __future__ import annotations

import glob
import json
import pathlib
from collections.abc import Iterator

from xmoe_jax.config import ConfigError

DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")
_GLOB_CHARS = set("*?[")
_BATCH_ROWS = 1024


def is_glob(path: str) -> bool:
    return bool(_GLOB_CHARS & set(path))


def _install_hint(package: str) -> str:
    return f"reading it needs {package}: pip install 'xmoe_jax[data]'"


def list_files(path: str, prefix: str) -> list[pathlib.Path]:
    """The document files of `path` (a file, a directory searched recursively, or a glob)."""
    where = f"{prefix}path={path!r}"
    if is_glob(path):
        files = sorted(pathlib.Path(p) for p in glob.glob(path, recursive=True) if pathlib.Path(p).is_file())
    elif pathlib.Path(path).is_dir():
        files = sorted(p for p in pathlib.Path(path).rglob("*") if p.suffix in DOCUMENT_SUFFIXES)
    elif pathlib.Path(path).is_file():
        files = [pathlib.Path(path)]
    else:
        raise ConfigError(f"{where} does not exist; set it to a file, a folder or a glob of documents")
    if not files:
        raise ConfigError(f"{where} holds no {'/'.join(DOCUMENT_SUFFIXES)} files; check the path or the glob")
    odd = [f for f in files if f.suffix not in DOCUMENT_SUFFIXES]
    if odd:
        raise ConfigError(
            f"{where}: {odd[0]} is not a {'/'.join(DOCUMENT_SUFFIXES)} file; narrow the glob or convert it"
        )
    return files


def _jsonl(file: pathlib.Path, text_field: str, prefix: str) -> Iterator[str]:
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{file}:{lineno} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove the line"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file}:{lineno} is not JSON ({e.msg}); fix the line or remove it") from e
            if not isinstance(record, dict) or text_field not in record:
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"{file}:{lineno} has no field {text_field!r} (it has {fields}); set {prefix}text_field"
                )
            yield record[text_field]


def _column_batches(table_batches, names: list[str], text_field: str, where: str, prefix: str):
    if text_field not in names:
        raise ConfigError(f"{where} has no column {text_field!r} (it has {names}); set {prefix}text_field")
    for batch in table_batches:
        yield from batch[text_field] if isinstance(batch, dict) else batch.column(text_field).to_pylist()


def _parquet(file: pathlib.Path, text_field: str, prefix: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"{file} is parquet; {_install_hint('pyarrow')}") from e
    import pyarrow as pa

    try:  # a damaged file fails when opened or at any batch
        pf = pq.ParquetFile(file)
        names = pf.schema_arrow.names
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]) if text_field in names else []
        yield from _column_batches(batches, names, text_field, str(file), prefix)
    except (pa.ArrowException, OSError) as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{file} is not a readable parquet file ({reason}); replace it or remove it from the input"
        ) from None


def file_documents(file: pathlib.Path, text_field: str, prefix: str) -> Iterator[str]:
    """The non-empty documents of one file, in order."""
    if file.suffix == ".txt":
        docs: Iterator[str] = iter([file.read_text(encoding="utf-8", errors="replace")])
    elif file.suffix == ".jsonl":
        docs = _jsonl(file, text_field, prefix)
    else:
        docs = _parquet(file, text_field, prefix)
    for text in docs:
        if text:
            if not isinstance(text, str):
                raise ConfigError(f"{file}: field {text_field!r} holds {type(text).__name__}, not text")
            yield text


def hf_dataset(path: str, split: str, prefix: str):
    """A `datasets.Dataset` from a save_to_disk directory (a Dataset or a DatasetDict's `split`) or
    from .arrow files (a file, a directory of them, or a glob)."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"{prefix}path={path!r} is a HuggingFace dataset; {_install_hint('datasets')}"
        ) from e
    root = pathlib.Path(path)
    saved = root.is_dir() and any((root / n).is_file() for n in ("state.json", "dataset_dict.json"))
    if saved:
        ds = datasets.load_from_disk(str(root))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(
                    f"{prefix}path={path!r} has splits {sorted(ds)}, not {split!r}; set {prefix}split"
                )
            ds = ds[split]
        return ds
    arrows = sorted(root.glob("*.arrow")) if root.is_dir() else sorted(map(pathlib.Path, glob.glob(path)))
    if not arrows:
        raise ConfigError(
            f"{prefix}path={path!r} is neither a datasets save_to_disk directory nor .arrow files; "
            "save it with Dataset.save_to_disk or point at the .arrow files"
        )
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(a)) for a in arrows])


def hf_documents(path: str, text_field: str, split: str, prefix: str) -> Iterator[str]:
    ds = hf_dataset(path, split, prefix)
    batches = ds.iter(batch_size=_BATCH_ROWS) if text_field in ds.column_names else []
    for text in _column_batches(batches, ds.column_names, text_field, f"{prefix}path={path!r}", prefix):
        if text:
            yield text
