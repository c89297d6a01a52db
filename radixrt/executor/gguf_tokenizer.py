"""A GGUF file's tokenizer from its `tokenizer.ggml.*` metadata, as radixrt's reader
(`gguf_file`) holds it: checked, then built by transformers' GGUF builders (its classes for each
vocabulary type llama.cpp names: SentencePiece `llama` (Gemma's and Phi-3's variants by
architecture), byte-level BPE `gpt2` with the split of llama.cpp's `tokenizer.ggml.pre`, `t5`'s
unigram), with the file's special tokens and its `add_bos_token`/`add_eos_token`.

transformers' own path (`AutoTokenizer.from_pretrained(..., gguf_file=...)`) reads the file a
second time with a reader that stops at the first string that is not UTF-8, and builds whatever
the metadata says: a merge naming a token the vocabulary lacks ends in tokenizers' bare
`Exception`, a byte-level vocabulary without merges has them derived from its vocabulary (a
minute for a mutated 49k-entry file). So, before anything is built:
- special token ids (bos, eos, unk, pad) lie within the vocabulary;
- scores and token types, where present, are one per token;
- merges, which a byte-level vocabulary must have (llama.cpp refuses one without), are each
  two tokens of the vocabulary joined by one space, whose join is a token too;
- merges derived from a SentencePiece vocabulary (Gemma's files list none) cost the sum of its
  tokens' squared lengths in string slices: bounded (`MAX_DERIVATION`; Gemma 3's 262k tokens
  take a few tens of millions);
and any other failure of the build is a ValueError naming the file, never another exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from radixrt.executor.gguf_file import GGUFFile, StringArray, shown

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

MAX_DERIVATION = 1 << 30  # string slices to derive a SentencePiece vocabulary's merges
# tokenizer_config's special tokens -> the metadata key of their ids
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def build(file: GGUFFile) -> PreTrainedTokenizerBase:
    """The tokenizer `file` describes (`file` read by `gguf_file.read` and checked by
    `gguf_file.check`); ValueError, one line naming the file and the field, when it cannot."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_SENTENCEPIECE_BUILDERS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = file.metadata
    grouped = {
        group: {
            n: _plain(meta[f"tokenizer.{k}"]) for k, n in keys.items() if f"tokenizer.{k}" in meta
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    spec, config = grouped["tokenizer"], grouped["tokenizer_config"]
    tokens = _check(file, spec)
    if spec.get("tokenizer_type") == "llama":  # llama.cpp's default for SentencePiece files
        config.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKENS.items():
        index = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[index] if isinstance(index, int) else None
    try:
        backend, extra = convert_gguf_tokenizer(file.architecture, spec)
        if (
            spec.get("tokenizer_type") == "llama"
            and file.architecture not in GGUF_SENTENCEPIECE_BUILDERS
        ):
            _spaces_as_llama_cpp(backend, spec.get("add_prefix_space", True))
        tokenizer: PreTrainedTokenizerBase = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=backend, **config, **extra
        )
    except Exception as e:  # tokenizers raises bare Exceptions
        problem = shown(f"{type(e).__name__}: {e}", 200)
        raise ValueError(
            f"{shown(file.path.name)}: its tokenizer cannot be built ({problem})"
        ) from None
    return tokenizer


def _spaces_as_llama_cpp(backend: Tokenizer, space_prefix: bool) -> None:
    """A SentencePiece vocabulary's spaces as llama.cpp (and sentencepiece) write them: every
    space a `▁`, and one more before the text and after each special token where the file asks
    for a prefix (`tokenizer.ggml.add_space_prefix`, on unless it says otherwise). transformers'
    Metaspace prepends only to text not already starting with a space, so " " was one `▁` where
    llama.cpp has two, and "   leading" three where it has four."""
    from tokenizers import normalizers

    steps = [normalizers.Prepend("\u2581")] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None


def _plain(value: Any) -> Any:
    """A metadata value as transformers' builders take it: arrays as lists."""
    return value.tolist() if isinstance(value, StringArray | np.ndarray) else value


def _check(file: GGUFFile, spec: dict[str, Any]) -> list[str]:
    """The vocabulary, after refusing what the builders would fail on or take unbounded time
    over (the module's docstring)."""
    name = shown(file.path.name)
    raw = file.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(raw, StringArray) or len(raw) == 0:
        raise ValueError(f"{name}: tokenizer.ggml.tokens is missing or empty")
    tokens: list[str] = spec["tokens"]
    for key in SPECIAL_TOKENS.values():
        index = file.metadata.get(f"tokenizer.ggml.{key}")
        if index is not None and not (isinstance(index, int) and 0 <= index < len(tokens)):
            raise ValueError(f"{name}: tokenizer.ggml.{key} {index!r} is not a token's id")
    for key in ("scores", "token_type"):
        if key in spec and len(spec[key]) != len(tokens):
            raise ValueError(
                f"{name}: tokenizer.ggml.{key} has {len(spec[key])} entries for {len(tokens)} tokens"
            )
    kind = spec.get("tokenizer_type")
    if kind == "gpt2":
        _check_merges(name, tokens, spec.get("merges"))
    elif kind == "llama" and "merges" not in spec:
        lengths = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
        work = int((lengths * lengths).sum())
        if work > MAX_DERIVATION:
            raise ValueError(
                f"{name}: deriving merges from tokenizer.ggml.tokens would take {work} string "
                f"slices, past {MAX_DERIVATION} (tokens of {int(lengths.max())} characters)"
            )
    return tokens


def _check_merges(name: str, tokens: list[str], merges: list[str] | None) -> None:
    """Each merge two tokens of the byte-level vocabulary (as transformers spells it) joined by
    one space, their join a token too."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if not merges:
        raise ValueError(f"{name}: a byte-level (gpt2) vocabulary needs tokenizer.ggml.merges")
    spelling: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens
    }
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if (
            len(parts) != 2
            or parts[0] not in vocab
            or parts[1] not in vocab
            or "".join(parts) not in vocab
        ):
            raise ValueError(
                f"{name}: tokenizer.ggml.merges[{i}] {shown(merge, 40)!r} is not two tokens of "
                "the vocabulary whose join is one"
            )
