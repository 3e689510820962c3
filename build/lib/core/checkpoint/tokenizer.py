"""A byte-level stand-in tokenizer for tiny test checkpoints.

The real DeepSeek-V4 tokenizer (a 129280-entry BPE) is not needed to test the
training stack; tiny checkpoints carry this one instead.

Ids::

    0            <bos>   (the official bos id)
    1            <eos>   (the official eos id)
    2 .. 257     the 256 byte values: id = byte + 2
    258 .. V-1   <pad_K>  padding up to the model's vocab_size, never produced by encode

Text is encoded as its UTF-8 bytes; ``decode`` skips special ids and decodes
the bytes with ``errors="replace"``.

File format, ``dsv4_byte_tokenizer.json`` in the checkpoint folder (UTF-8 JSON)::

    {"type": "dsv4-byte-tokenizer", "version": 1,
     "vocab_size": V, "bos_token_id": 0, "eos_token_id": 1, "byte_offset": 2}

This is *not* a HuggingFace ``tokenizers`` file; the ``type`` key says so and
:func:`load_tokenizer` rejects anything else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List

from .errors import CheckpointError

TOKENIZER_FILE = "dsv4_byte_tokenizer.json"  # not named tokenizer.json: it is not a HF tokenizers file
TOKENIZER_TYPE = "dsv4-byte-tokenizer"
BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2
MIN_VOCAB = BYTE_OFFSET + 256


@dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer; see the module docstring for the id layout."""

    vocab_size: int = MIN_VOCAB
    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID

    def __post_init__(self):
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB}, got {self.vocab_size}")

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> List[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) - BYTE_OFFSET for i in ids if BYTE_OFFSET <= int(i) < MIN_VOCAB)
        return data.decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"type": TOKENIZER_TYPE, "version": 1, "vocab_size": self.vocab_size,
                           "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                           "byte_offset": BYTE_OFFSET}, indent=2) + "\n"

    def save(self, ckpt_dir) -> Path:
        p = Path(ckpt_dir) / TOKENIZER_FILE
        p.write_text(self.to_json())
        return p


def load_tokenizer(ckpt_dir) -> ByteTokenizer:
    """Read ``dsv4_byte_tokenizer.json`` of a checkpoint written by :mod:`core.checkpoint.tiny`."""
    p = Path(ckpt_dir) / TOKENIZER_FILE
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError("tokenizer file not found", file=str(p)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"malformed JSON: {e}", file=str(p)) from e
    if not isinstance(d, dict) or d.get("type") != TOKENIZER_TYPE or d.get("version") != 1:
        raise CheckpointError(f"not a {TOKENIZER_TYPE} v1 file", file=str(p))
    if d.get("byte_offset", BYTE_OFFSET) != BYTE_OFFSET:
        raise CheckpointError(f"unsupported byte_offset {d.get('byte_offset')!r}", file=str(p))
    try:
        return ByteTokenizer(int(d["vocab_size"]), int(d.get("bos_token_id", BOS_ID)),
                             int(d.get("eos_token_id", EOS_ID)))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"invalid tokenizer file: {e}", file=str(p)) from e
