"""Text <-> token ids for generation: byte-level for now (ids 0..255, what `data.source=text`
trains on). One pair of functions, so the CLI can later take the tokenizer of the `data`
package (bytes / HuggingFace tokenizers / sentencepiece) in their place."""

from __future__ import annotations

from collections.abc import Sequence

BYTE_VOCAB = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """UTF-8 of the byte ids (ids outside 0..255 are dropped, broken sequences replaced)."""
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")
