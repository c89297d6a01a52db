"""A tokenizer's tokens as the bytes they stand for: the outlines-core `Vocabulary` the constraint
automata are built over, and the byte table jump-forward reads."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from outlines_core import Vocabulary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_VOCAB_CACHE: dict[tuple[int, str, int], Vocabulary] = {}


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], bytes]:
    """How a vocabulary token string turns into the bytes it stands for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        kind = backend.decoder.__getstate__().decode()
    else:
        tokens = tokenizer.get_vocab()
        kind = (
            "Metaspace"
            if any(t.startswith("▁") for t in tokens)
            else "ByteLevel"
            if "Ġ" in tokens
            else ""
        )
    if "ByteLevel" in kind:
        table = _gpt2_unicode_to_byte()
        return lambda token: (
            bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
        )
    if "Metaspace" in kind or "ByteFallback" in kind or "▁" in kind:

        def sentencepiece(token: str) -> bytes:
            match = _SP_BYTE.fullmatch(token)
            return bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode()

        return sentencepiece
    return str.encode


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> dict[int, bytes]:
    """id -> the bytes a token stands for, for every token but the special ones (EOS included);
    non-special added tokens count as their literal UTF-8 text."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    decode = _token_decoder(tokenizer)
    return {
        token_id: added[token_id].content.encode() if token_id in added else decode(token)
        for token, token_id in tokenizer.get_vocab().items()
        if token_id not in special
    }


def build_vocabulary(
    tokenizer: PreTrainedTokenizerBase, mapping: dict[int, bytes] | None = None
) -> Vocabulary:
    """The tokenizer's vocabulary for outlines-core: `token_bytes` (or the `mapping` already made
    from it) grouped by bytes, EOS given separately. Cached per tokenizer."""
    key = (id(tokenizer), tokenizer.name_or_path, len(tokenizer))
    if key in _VOCAB_CACHE:
        return _VOCAB_CACHE[key]
    if tokenizer.eos_token_id is None:
        raise ValueError("constrained generation needs a tokenizer with an EOS token")
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, data in (mapping or token_bytes(tokenizer)).items():
        if data:
            by_bytes.setdefault(data, []).append(token_id)
    vocabulary = Vocabulary(tokenizer.eos_token_id, by_bytes)
    _VOCAB_CACHE[key] = vocabulary
    return vocabulary


class TokenTable:
    """What jump-forward needs to know of a tokenizer's tokens, as bytes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int):
        self.tokenizer = tokenizer
        self.mapping = token_bytes(tokenizer)
        self.bytes_of = [self.mapping.get(i, b"") for i in range(vocab_size)]
        self.first_byte = np.array(
            [data[0] if data else -1 for data in self.bytes_of], dtype=np.int16
        )
        self.lengths = np.array([len(data) for data in self.bytes_of], dtype=np.int32)
        self.byte_token = {data[0]: i for i, data in self.mapping.items() if len(data) == 1}

    def encode(self, data: bytes) -> list[int] | None:
        """The tokenizer's own ids for `data`, or None when they would not spell exactly these bytes."""
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids if b"".join(self.bytes_of[i] for i in ids) == data else None
