"""Where the tokens come from: training sources (one or a weighted mixture), the tokenizer, and
held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass

from xmoe_jax.config.checks import _check, _check_choices, _check_numbers
from xmoe_jax.config.choices import DataSource


@dataclass(frozen=True)
class SourceConfig:
    """One dataset: where it is and how to read it (`xmoe_jax/data/sources.py` opens each kind).

    source: `auto` (detected from `path`: none = synthetic), `synthetic`, `text` (one file, one
      token stream, no end-of-document marks), `files` (a folder or glob of .txt / .jsonl /
      .parquet: every file, line or row a document), `hf` (a `datasets` save_to_disk directory
      or .arrow files), `arrayrecord` (shards written by xmoe-tokenize), `megatron` (.bin + .idx).
    text_field: the text column of jsonl / parquet / hf documents.
    split: the split of a saved `datasets.DatasetDict`.
    weight: share of a mixture (relative; normalised over the mixture).
    """

    source: DataSource = "auto"
    path: str | None = None
    text_field: str = "text"
    split: str = "train"
    weight: float = 1.0

    def check(self, prefix: str) -> None:
        """Validation with the caller's prefix (`data.`, `data.mixture[2].`, `eval.data.`)."""
        _check_choices(self, prefix)
        if self.source not in ("auto", "synthetic"):
            _check(self.path is not None, f"{prefix}source={self.source!r} needs {prefix}path=<location>")
        _check(
            not (self.source == "synthetic" and self.path is not None),
            f"{prefix}source='synthetic' reads no {prefix}path={self.path!r}; set {prefix}source=auto "
            "(detected from the path) or name the kind",
        )
        _check(self.weight > 0, f"{prefix}weight={self.weight} must be > 0")
        _check(bool(self.text_field), f"{prefix}text_field must name the text column, e.g. 'text'")
        _check_numbers(self, prefix)


@dataclass(frozen=True)
class DataConfig:
    """Training input: one source (`source`, `path`, ...) or a weighted `mixture` of sources,
    tokenized with `tokenizer` (`bytes`, a tokenizer.json, a transformers tokenizer directory or a
    sentencepiece .model) and packed into windows of seq_len + 1 tokens. `auto` (the default) is the
    tokenizer xmoe-tokenize recorded with pre-tokenized data, else `bytes`
    (`xmoe_jax/data/provenance.py` resolves it before training)."""

    source: DataSource = "auto"
    path: str | None = None
    text_field: str = "text"
    split: str = "train"
    mixture: tuple[SourceConfig, ...] = ()
    tokenizer: str = "auto"
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        _check_choices(self, "data.")
        _check(
            bool(self.tokenizer), "data.tokenizer must be 'auto', 'bytes' or a tokenizer file or directory"
        )
        if self.mixture:
            _check(
                self.source == "auto" and self.path is None,
                "data.mixture and data.source/data.path are alternatives; move the single source into "
                "the mixture list (data.mixture: [{path: ..., weight: ...}, ...])",
            )
        for i, src in enumerate(self.mixture):
            src.check(f"data.mixture[{i}].")
        if not self.mixture:
            self.sources[0].check("data.")
        _check_numbers(self, "data.")

    @property
    def sources(self) -> tuple[SourceConfig, ...]:
        """The mixture, or the single source as a mixture of one."""
        if self.mixture:
            return self.mixture
        return (SourceConfig(self.source, self.path, self.text_field, self.split),)

    @property
    def byte_level(self) -> bool:
        """Text is read as bytes (256 ids): the model needs vocab_size >= 256. Sources whose kind
        is detected from the path (`auto`) are checked when they are opened."""
        return self.tokenizer in ("bytes", "auto") and any(
            s.source in ("text", "files", "hf") for s in self.sources
        )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: every `every` steps (0 = never during training; `xmoe-eval` still
    works), `steps` batches of train.batch_size from the same start each time, on the last
    `holdout` fraction of every training source (taken out of training) or on `data`."""

    every: int = 0
    steps: int = 10
    holdout: float = 0.0
    data: SourceConfig | None = None

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"eval.every={self.every} must be >= 0 (0 = no evaluation during training)")
        _check(self.steps >= 1, f"eval.steps={self.steps} must be >= 1")
        _check(0 <= self.holdout < 1, f"eval.holdout={self.holdout} must be in [0, 1) (a fraction)")
        _check(
            not (self.holdout > 0 and self.data is not None),
            "eval.holdout and eval.data are alternatives (a held-out split of the training data, or "
            "another dataset); set one of them",
        )
        if self.data is not None:
            self.data.check("eval.data.")
        _check(
            self.every == 0 or self.holdout > 0 or self.data is not None,
            f"eval.every={self.every} needs eval data: set eval.holdout (e.g. 0.01) or eval.data.path",
        )
        _check_numbers(self, "eval.")

    @property
    def has_data(self) -> bool:
        return self.holdout > 0 or self.data is not None
