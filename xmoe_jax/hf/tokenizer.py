"""The run's tokenizer in an export, so `AutoTokenizer.from_pretrained(out)` gives one too.

Why: an exported model without its tokenizer reads ids nobody can produce. The run's tokenizer is
its copy in `<run_dir>/tokenizer/` (`xmoe_jax/data/provenance.py`), else `data.tokenizer`; a
tokenizers JSON goes out as tokenizer.json with a tokenizer_config.json naming the fast tokenizer
class and the end-of-document token; a sentencepiece model as tokenizer.model. The `bytes`
tokenizer is written as an equivalent byte-level tokenizer.json: 256 tokens, id = byte value,
no merges, eos = id 0, so text encodes to the same ids the model was trained on.
"""

from __future__ import annotations

import json
import pathlib

from xmoe_jax.data import provenance
from xmoe_jax.data.tokenizer import BYTES_EOS, BYTES_VOCAB, load_tokenizer

FAST_CLASS = "PreTrainedTokenizerFast"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what `tokenizers`' ByteLevel maps bytes to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out, extra = {}, 0
    for b in range(BYTES_VOCAB):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(BYTES_VOCAB + extra)
            extra += 1
    return out


def write_bytes_tokenizer(out_dir: pathlib.Path) -> None:
    """tokenizer.json + tokenizer_config.json equal to the `bytes` tokenizer (id = UTF-8 byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(BYTES_VOCAB)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": FAST_CLASS, "eos_token": chars[BYTES_EOS], "model_max_length": 1 << 30}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def export_tokenizer(copy: pathlib.Path, tokenizer: str, out_dir: pathlib.Path) -> list[str]:
    """Writes the run's tokenizer (its copy `copy`, `RunDir.tokenizer`, else `tokenizer`) into
    `out_dir`; returns the file names written."""
    name = str(copy) if copy.is_dir() else tokenizer
    if name in (provenance.BYTES, provenance.AUTO):
        write_bytes_tokenizer(out_dir)
        return ["tokenizer.json", "tokenizer_config.json"]
    files = provenance.tokenizer_files(name)
    provenance.copy_tokenizer(name, out_dir)
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        loaded = load_tokenizer(str(out_dir))  # finds the eos token among the usual spellings
        eos = loaded._tok.id_to_token(loaded.eos_id)
        config = {"tokenizer_class": FAST_CLASS, "eos_token": eos}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        return [*files, "tokenizer_config.json"]
    return list(files)
