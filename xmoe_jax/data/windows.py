"""Random-access training examples: windows of W = seq_len + 1 tokens.

Why windows over one token stream: every source (a text file, tokenized documents, Megatron
.bin, ArrayRecord shards) becomes a `TokenStream`, a 1-D sequence of token ids that can be read
at any offset. Packing is then one rule for all of them: window i is tokens
[i * S, i * S + W) of the stream, so consecutive windows overlap by one token (every token after
the first is a target exactly once per epoch) and a window may span documents, which are separated
by the end-of-document id the source put after each of them. A window is a pure function of its
index, so grain's index-based iterator state resumes exactly.

Shapes: S = seq_len, W = S + 1, N = tokens in the stream.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

SYNTHETIC_STRIDES = (1, 2, 3, 5)  # small set: the stride is inferable from two tokens
SYNTHETIC_EXAMPLES = 1 << 20  # one synthetic "epoch"; examples are made on demand


class TokenStream(Protocol):
    """A 1-D sequence of token ids readable at any offset."""

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class ArrayStream:
    """A token stream held by a 1-D array: in memory (tokenized at start-up) or a np.memmap
    (a byte file, a Megatron .bin), never copied."""

    def __init__(self, tokens_N: np.ndarray) -> None:
        self._tokens_N = tokens_N

    def __len__(self) -> int:
        return len(self._tokens_N)

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._tokens_N[start:stop], dtype=np.int32)


class SyntheticWindows:
    """Arithmetic progressions mod `vocab_size`: tokens_W[t] = (start + stride * t) % V.

    Why this source: it is deterministic per (seed, index), needs no files, and is
    learnable in a few steps. A bigram already narrows the next token to
    len(SYNTHETIC_STRIDES) choices (loss log 4 instead of log V); a model that
    attends to the previous token can infer the stride and drive loss to ~0
    after the first position. `start` is uniform in [0, V).
    """

    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self._window = seq_len + 1
        self._vocab_size = vocab_size
        self._seed = seed

    def __len__(self) -> int:
        return SYNTHETIC_EXAMPLES

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self._seed, int(index)))
        start = int(rng.integers(self._vocab_size))
        stride = SYNTHETIC_STRIDES[int(rng.integers(len(SYNTHETIC_STRIDES)))]
        steps_W = np.arange(self._window, dtype=np.int64)
        return ((start + stride * steps_W) % self._vocab_size).astype(np.int32)


class PackedWindows:
    """Windows of `seq_len + 1` tokens at stride `seq_len` over a token stream.

    `vocab_size` bounds the ids: a window holding an id the model cannot embed raises instead of
    being clamped silently by the embedding lookup (pre-tokenized data is not scanned up front).
    """

    def __init__(self, stream: TokenStream, seq_len: int, vocab_size: int, name: str) -> None:
        self.stream = stream
        self._seq_len = seq_len
        self._vocab_size = vocab_size
        self._name = name
        self._num_windows = max(0, (len(stream) - 1) // seq_len)

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(index) * self._seq_len
        tokens_W = self.stream.read(start, start + self._seq_len + 1)
        if tokens_W.size and int(tokens_W.max()) >= self._vocab_size:
            raise ValueError(
                f"{self._name}: token id {int(tokens_W.max())} at window {int(index)} is >= "
                f"model.vocab_size={self._vocab_size}; the data was tokenized with a larger vocabulary"
            )
        return tokens_W
