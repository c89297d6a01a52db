"""Incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output so leading spaces come out right


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each token is decoded together with a few tokens before it, and text is released only once
    it no longer ends in U+FFFD (the mark of bytes that do not yet form a character).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # honoured by the tokenizers that have the option; fast ones ignore it
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        # one list of ids decodes to one string (a list of strings is for a batch of lists)
        # passed only when off: it is on by default where a tokenizer has it at all
        spaces = (
            {} if self.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        )
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **spaces)
        return cast(str, text)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is held back, at the end of generation."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]
