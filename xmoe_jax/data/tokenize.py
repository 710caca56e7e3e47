"""`xmoe-tokenize`: documents (.txt / .jsonl / .parquet) -> pre-tokenized ArrayRecord shards.

Why once, ahead of training: the trainer tokenizes small corpora at start-up, in memory; a large
corpus is tokenized here once and then memory-light and random-access (`arrayrecord.py`).

Resumable: a shard is written to a temporary file and renamed when full, then the manifest
records it with the position after its last document (input file, document within the file). An
interrupted job rerun with the same arguments drops the unfinished shard, skips the documents
already in committed shards and goes on; the result is the same as an uninterrupted run's. The
manifest's `complete` flag is set at the end; the trainer refuses an incomplete output. The
manifest also records each input's size and a hash of its head and tail (`fingerprint.py`): a
rerun over inputs edited in between is refused, naming the file, since it would mix old and new
text. The caller may hold a lock on the output while the job runs (`lock`: `xmoe-tokenize` takes
the run directory's kind of lock, `<output>/tokenize.lock`), so two jobs never write one output.
The output folder is created with its parents. A write that fails (a full disk, a quota, a file-size
limit) is a `storage.WriteError` naming the file, its unfinished file removed: the same command
resumes once there is room.

The tokenizer travels with the shards: a copy in `<output>/tokenizer/` and its fingerprint in the
manifest (`tokenizer_sha256`), from which the trainer takes `data.tokenizer` (`provenance.py`).

Steps (`tokenize_to_shards`):
  1. list the input files (sorted), load the tokenizer, check the output path, take the lock,
     read an existing manifest (same job, same inputs?), copy the tokenizer beside the shards;
  2. read documents from the saved position, encode them in batches, append eos to each;
  3. write documents to the current shard; past `shard_tokens` commit it and record the position;
  4. commit the last shard, mark the manifest complete and return the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import Callable, Iterator

import numpy as np

from xmoe_jax import storage
from xmoe_jax.config import ConfigError
from xmoe_jax.data import documents, fingerprint, provenance
from xmoe_jax.data.arrayrecord import FORMAT, ShardWriter, read_manifest, token_dtype, write_manifest
from xmoe_jax.data.sources import ENCODE_BATCH, batched
from xmoe_jax.data.tokenizer import load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 27  # 128M tokens: 256 MB of uint16 ids per shard
LOCK_NAME = "tokenize.lock"
WRITE_FIX = (
    "free space, raise the quota or the file-size limit (ulimit -f), then run the same command: it "
    "resumes after the last finished shard"
)


@dataclasses.dataclass(frozen=True)
class Summary:
    output: pathlib.Path
    documents: int
    tokens: int
    shards: int
    resumed_shards: int  # shards that were already there when this call started
    vocab_size: int  # model.vocab_size must be at least this

    def __str__(self) -> str:
        resumed = f" ({self.resumed_shards} already there, resumed)" if self.resumed_shards else ""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens, {self.shards} shard(s) in "
            f"{self.output}{resumed}; vocabulary {self.vocab_size} ids"
        )


def _job(inputs: list[pathlib.Path], tokenizer, text_field: str, shard_tokens: int) -> dict:
    """What identifies a job: a rerun must match it to resume."""
    return {
        "format": FORMAT,
        "version": 1,
        "inputs": [str(p) for p in inputs],
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "text_field": text_field,
        "shard_tokens": shard_tokens,
    }


def _documents(
    files: list[pathlib.Path], text_field: str, start: tuple[int, int]
) -> Iterator[tuple[int, int, str]]:
    """(file index, document index in the file, text) from position `start` on."""
    first_file, first_doc = start
    for fi in range(first_file, len(files)):
        for di, text in enumerate(documents.file_documents(files[fi], text_field, "")):
            if fi > first_file or di >= first_doc:
                yield fi, di, text


def tokenize_to_shards(
    inputs: str,
    tokenizer_name: str,
    output: str | pathlib.Path,
    *,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    report: Callable[[str], None] = lambda line: None,
    lock: Callable[[pathlib.Path], contextlib.AbstractContextManager] | None = None,
) -> Summary:
    """Tokenizes the documents of `inputs` (a file, folder or glob) into shards under `output`;
    resumes a job that was interrupted. `lock(output)`, if given, is held while the job reads and
    writes the output. `ConfigError` for bad inputs, an output that is a file, another job's
    output or inputs edited since the job began; `storage.WriteError` for a write that failed."""
    if shard_tokens < 1:
        raise ConfigError(
            f"--shard-tokens={shard_tokens} must be >= 1 (tokens per shard); leave it out for the "
            f"default {DEFAULT_SHARD_TOKENS:,}"
        )
    files = documents.list_files(inputs, "")
    tokenizer = load_tokenizer(tokenizer_name)
    out = pathlib.Path(output)
    make_output(out)
    try:
        with lock(out) if lock is not None else contextlib.nullcontext():
            return _run(inputs, files, tokenizer, tokenizer_name, out, text_field, shard_tokens, report)
    except storage.WriteError as e:
        raise e.with_fix(WRITE_FIX) from e


def make_output(out: pathlib.Path) -> None:
    """Creates the output folder (and its parents); `ConfigError` if it or a parent is a file."""
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            what = "is a file" if path == out else f"is under {path}, a file"
            raise ConfigError(f"--output {out} {what}, not a folder; choose a folder for the shards")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--output {out} cannot be created ({e.strerror or e}); choose a writable folder"
        ) from e


def _run(inputs, files, tokenizer, tokenizer_name, out, text_field, shard_tokens, report) -> Summary:
    job = _job(files, tokenizer, text_field, shard_tokens)
    prints = fingerprint.files_table(files, fingerprint.root_of(inputs))
    manifest = read_manifest(out)
    if manifest is None:
        sha = provenance.fingerprint(tokenizer_name)
        manifest = {
            **job,
            "tokenizer_sha256": sha,
            "input_fingerprints": prints,
            "shards": [],
            "complete": False,
        }
    elif {k: manifest.get(k) for k in job} != job:
        differs = sorted(k for k in job if manifest.get(k) != job[k])
        raise ConfigError(
            f"--output {out} holds another job (it differs in {differs}); choose a new --output"
        )
    elif "input_fingerprints" in manifest:  # outputs of earlier versions have none
        edited = fingerprint.changed_file(manifest["input_fingerprints"], prints)
        if edited and manifest["complete"]:
            raise ConfigError(
                f"--input {inputs} changed since --output {out} was tokenized from it: {edited}; tokenize "
                "into a new --output (or restore the file)"
            )
        if edited:
            raise ConfigError(
                f"--input {inputs} changed since --output {out} was begun from it: {edited}; going on would "
                "mix its old and new text. Restore the file, or tokenize into a new --output"
            )
    if not (out / provenance.COPY_DIR).is_dir():
        provenance.copy_tokenizer(tokenizer_name, out / provenance.COPY_DIR)
    done = len(manifest["shards"])
    if not manifest["complete"]:
        for stray in [*out.glob("*.tmp"), *out.glob(".*.partial")]:  # a killed job's unfinished files
            stray.unlink()
        start = (
            (manifest["shards"][-1]["next_input"], manifest["shards"][-1]["next_document"])
            if done
            else (0, 0)
        )
        if done:
            report(
                f"resuming after shard {done - 1} at input {start[0] + 1}/{len(files)}, document {start[1]}"
            )
        _write(manifest, files, tokenizer, out, start, report)
    shards = manifest["shards"]
    num_docs, num_tokens = sum(s["documents"] for s in shards), sum(s["tokens"] for s in shards)
    return Summary(out, num_docs, num_tokens, len(shards), done, manifest["vocab_size"])


def _write(manifest: dict, files: list[pathlib.Path], tokenizer, out: pathlib.Path, start, report) -> None:
    dtype = np.dtype(manifest["dtype"])
    eos = [tokenizer.eos_id]
    writer = ShardWriter(out, len(manifest["shards"]), dtype)

    def commit(next_pos: tuple[int, int]) -> None:
        entry = writer.commit() | {"next_input": next_pos[0], "next_document": next_pos[1]}
        manifest["shards"].append(entry)
        write_manifest(out, manifest)
        report(
            f"shard {len(manifest['shards']) - 1:05d}: {entry['documents']:,} documents, "
            f"{entry['tokens']:,} tokens (input {min(next_pos[0] + 1, len(files))}/{len(files)})"
        )

    try:
        for batch in batched(_documents(files, manifest["text_field"], start), ENCODE_BATCH):
            encoded = tokenizer.encode_batch([text for _, _, text in batch])
            for (fi, di, _), ids in zip(batch, encoded, strict=True):
                writer.write(np.asarray(ids + eos))
                if writer.tokens >= manifest["shard_tokens"]:
                    commit((fi, di + 1))
                    writer = ShardWriter(out, len(manifest["shards"]), dtype)
        if writer.lengths:
            commit((len(files), 0))
        else:
            writer.abort()
    except BaseException:
        writer.abort()  # the unfinished shard is redone by the next run
        raise
    if not manifest["shards"]:
        raise ConfigError(f"the inputs hold no documents with text in field {manifest['text_field']!r}")
    manifest["complete"] = True
    write_manifest(out, manifest)
