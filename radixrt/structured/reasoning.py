"""Constraints that start after the reasoning block (`--reasoning-parser`).

A reasoning model thinks in `<think>…</think>` and answers after it, so a request's constraint (a
regex, a JSON schema, a required tool call) applies from the token after `</think>`, and the
reasoning is free: bounded only by the request's `max_reasoning_tokens`, after which `</think>` is
forced. SGLang and vLLM do the same. `ReasoningGuide` wraps the request's own `GrammarGuide` (or
none: a request with a reasoning budget and no constraint) and walks four phases:

- `OPENING`: the prompt left no block open, so the reply may open one. Its first token is either
  one the constraint allows (the model answers at once: `ANSWER`) or the start of `<think>`.
- `THINKING`: anything but a stop token (an answer is owed) and but a token that would close the
  block with text after `</think>` inside the same token (that text would escape the constraint).
- `CLOSING`: the budget is spent; the tokens of `</think>` are forced one by one.
- `ANSWER`: the wrapped guide decides (everything is allowed when there is none).

Tags are matched on the tokens' bytes, not on token ids, so a tokenizer that spells `</think>` in
several tokens is read like one with a single tag token. A reply starts in `THINKING` when its
prompt ends inside an open block (a chat template or a prefill opened it), and always under a
parser whose replies start inside the block (`OPENS_THINKING`: DeepSeek-R1's template opens it,
and its parser reads a reply as reasoning up to `</think>`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from radixrt.structured.grammar import GrammarGuide

if TYPE_CHECKING:  # the HTTP gateway reads the tags from here and imports neither
    import torch

    from radixrt.structured.vocabulary import TokenTable

THINK_START = "<think>"
THINK_END = "</think>"
# each reasoning parser (`--reasoning-parser`): whether its replies start inside the block
OPENS_THINKING = {"deepseek-r1": True, "qwen3": False}
_START = THINK_START.encode()
_END = THINK_END.encode()


class Phase(Enum):
    OPENING = "opening"
    THINKING = "thinking"
    CLOSING = "closing"
    ANSWER = "answer"


class Step(Enum):
    """What a token did to a walk: refused; taken by the walk (reasoning, a tag); or the
    answer's first token, which the wrapped guide takes too."""

    REFUSED = "refused"
    TAKEN = "taken"
    ANSWERS = "answers"


@dataclass(frozen=True, eq=False)
class ThinkTags:
    """What every walk of one tokenizer shares: its tokens' bytes, the ids that may spell part of
    `<think>` (`openers`) or complete `</think>` (`closers`: every token with a `>`), the ids
    that spell `</think>` alone, and the ids that stop a request (masked while it thinks)."""

    bytes_of: list[bytes]
    openers: np.ndarray
    closers: np.ndarray
    close_ids: tuple[int, ...]
    stop_ids: np.ndarray
    _bad: dict[bytes, np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, tokens: TokenTable, stop_ids: set[int]) -> ThinkTags:
        """From the compiler's token table; `stop_ids`: the model's EOS ids and the tokenizer's."""
        close_ids = tokens.encode(_END)
        if not close_ids:
            raise ValueError(f"the tokenizer cannot spell {THINK_END!r}")
        suffixes = [_START[k:] for k in range(len(_START))]
        openers = [
            i
            for i, data in enumerate(tokens.bytes_of)
            if data and any(s.startswith(data) or data.startswith(s) for s in suffixes)
        ]
        closers = [i for i, data in enumerate(tokens.bytes_of) if b">" in data]
        return cls(
            tokens.bytes_of,
            np.array(openers, dtype=np.int64),
            np.array(closers, dtype=np.int64),
            tuple(close_ids),
            np.array(sorted(stop_ids), dtype=np.int64),
        )

    def openers_after(self, opened: bytes) -> np.ndarray:
        """The ids that go on spelling `<think>` after `opened` of it (or finish it)."""
        fits = [
            t
            for t in self.openers.tolist()
            if _START.startswith(opened + self.bytes_of[t])
            or (opened + self.bytes_of[t]).startswith(_START)
        ]
        return np.array(fits, dtype=np.int64)

    def bad_closers(self, tail: bytes) -> np.ndarray:
        """The ids that would close the block after reasoning ending in `tail` with text after
        `</think>` inside the token. Only the end of `tail` that `</think>` starts with matters,
        so the answer is cached per such end (eight at most)."""
        key = next((tail[k:] for k in range(len(tail)) if _END.startswith(tail[k:])), b"")
        if key not in self._bad:
            bad = [t for t in self.closers.tolist() if _closes_badly(key, self.bytes_of[t])]
            self._bad[key] = np.array(bad, dtype=np.int64)
        return self._bad[key]

    def prompt_opens(self, input_ids: list[int]) -> bytes | None:
        """The prompt's text after a `<think>` it leaves open (the reasoning already written), or
        None when it opens no block."""
        text = b"".join(self.bytes_of[i] for i in input_ids if i < len(self.bytes_of))
        start = text.rfind(_START)
        if start < 0 or text.rfind(_END) > start:
            return None
        return text[start + len(_START) :]


@dataclass
class Walk:
    """Where a reply stands before its answer: the phase, the part of `<think>` written so far
    (`OPENING`), the last bytes of the reasoning (a `</think>` may span tokens), the reasoning
    tokens written, and the forced tokens left (`CLOSING`)."""

    phase: Phase
    opened: bytes = b""
    tail: bytes = b""
    thought: int = 0
    forced: list[int] = field(default_factory=list)


class ReasoningGuide:
    """A `GrammarGuide` whose wrapped constraint (`inner`, or none) starts after the reasoning
    block; `budget` is the request's `max_reasoning_tokens` (None: unbounded); `inside`: the
    reply starts inside the block whatever its prompt (`OPENS_THINKING`)."""

    def __init__(
        self,
        tags: ThinkTags,
        inner: GrammarGuide | None,
        input_ids: list[int],
        budget: int | None,
        inside: bool = False,
    ):
        self.tags = tags
        self.inner = inner
        self.budget = budget
        reasoning = tags.prompt_opens(input_ids)
        if reasoning is None and not inside:
            self.walk = Walk(Phase.OPENING)
        else:
            self.walk = Walk(Phase.THINKING, tail=(reasoning or b"")[-len(_END) :])
        if self._spent(self.walk):
            self._close(self.walk)

    # ---- the walk, without the inner guide ---------------------------------------------------
    def _spent(self, walk: Walk) -> bool:
        return (
            walk.phase is Phase.THINKING and self.budget is not None and walk.thought >= self.budget
        )

    def _close(self, walk: Walk) -> None:
        walk.phase, walk.forced = Phase.CLOSING, list(self.tags.close_ids)

    def _inner_allows(self, token: int) -> bool:
        return self.inner is not None and self.inner.allowed_prefix([token]) == 1

    def _step(self, walk: Walk, token: int) -> Step:
        """Move `walk` (never the inner guide) past `token`, a token before the answer's."""
        data = self.tags.bytes_of[token] if token < len(self.tags.bytes_of) else b""
        if walk.phase is Phase.OPENING:
            opened = walk.opened + data
            if not walk.opened and self._inner_allows(token):
                walk.phase = Phase.ANSWER
                return Step.ANSWERS
            if _START in opened:
                walk.phase, walk.tail = Phase.THINKING, opened[opened.index(_START) + len(_START) :]
            elif data and _START.startswith(opened):
                walk.opened = opened
            elif self.inner is None:
                walk.phase = Phase.ANSWER  # no constraint: text that is no tag is the answer
                return Step.ANSWERS
            else:
                return Step.REFUSED
        elif walk.phase is Phase.THINKING:
            if token in self.tags.stop_ids or _closes_badly(walk.tail, data):
                return Step.REFUSED
            walk.thought += 1
            text = walk.tail + data
            if _END in text:
                walk.phase = Phase.ANSWER
            else:
                walk.tail = text[-len(_END) :]
                if self._spent(walk):
                    self._close(walk)
        elif walk.phase is Phase.CLOSING:
            if token != walk.forced[0]:
                return Step.REFUSED
            walk.forced.pop(0)
            if not walk.forced:
                walk.phase = Phase.ANSWER
        return Step.TAKEN

    # ---- GrammarGuide ---------------------------------------------------------------------------
    def advance(self, token_id: int) -> None:
        if self.walk.phase is Phase.ANSWER:
            if self.inner is not None:
                self.inner.advance(token_id)
            return
        phase = self.walk.phase
        step = self._step(self.walk, token_id)
        if step is Step.REFUSED:
            raise ValueError(f"token {token_id} is not allowed in the {phase.value} phase")
        if step is Step.ANSWERS and self.inner is not None:
            self.inner.advance(token_id)

    def jump_forward(self, token_id: int) -> list[int]:
        answering = self.walk.phase is Phase.ANSWER or (
            self.walk.phase is Phase.OPENING
            and not self.walk.opened
            and self._inner_allows(token_id)
        )
        if answering and self.inner is not None:
            return self.inner.jump_forward(token_id)
        return [token_id]

    def allowed_prefix(self, token_ids: list[int]) -> int:
        walk = copy.deepcopy(self.walk)
        for i, token in enumerate(token_ids):
            if walk.phase is Phase.ANSWER:
                rest = token_ids[i:]
                return i + (self.inner.allowed_prefix(rest) if self.inner else len(rest))
            step = self._step(walk, token)
            if step is Step.REFUSED:
                return i
            if step is Step.ANSWERS and self.inner is not None:
                return i + self.inner.allowed_prefix(token_ids[i:])
        return len(token_ids)

    def is_final(self) -> bool:
        if self.walk.phase is not Phase.ANSWER:
            return False
        return self.inner.is_final() if self.inner is not None else True

    def allowed_only_eos(self) -> bool:
        return (
            self.walk.phase is Phase.ANSWER
            and self.inner is not None
            and self.inner.allowed_only_eos()
        )

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        walk, words = self.walk, bitmask_row.numpy()
        if walk.phase is Phase.THINKING:
            words.fill(-1)
            _clear(words, self.tags.stop_ids)
            _clear(words, self.tags.bad_closers(walk.tail))
        elif walk.phase is Phase.CLOSING:
            words.fill(0)
            _set(words, np.array(walk.forced[:1], dtype=np.int64))
        elif walk.phase is Phase.ANSWER or not walk.opened:
            if self.inner is not None:
                self.inner.fill_mask(bitmask_row)
            else:
                words.fill(-1)
            if walk.phase is Phase.OPENING:
                _set(words, self.tags.openers_after(b""))
        elif self.inner is None:
            words.fill(-1)  # part of <think> written: it goes on, or the text is the answer
        else:
            words.fill(0)
            _set(words, self.tags.openers_after(walk.opened))


def _closes_badly(tail: bytes, data: bytes) -> bool:
    """Whether a token of bytes `data` after reasoning ending in `tail` completes `</think>` with
    something other than whitespace after it, inside the token."""
    text = tail + data
    at = text.find(_END)
    return at >= 0 and bool(text[at + len(_END) :].strip())


def _bits(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    words = ids >> 5
    bits = (np.int64(1) << (ids & 31)).astype(np.uint32).view(np.int32)
    return words, bits


def _set(words: np.ndarray, ids: np.ndarray) -> None:
    ids = ids[ids < 32 * len(words)]
    at, bits = _bits(ids)
    np.bitwise_or.at(words, at, bits)


def _clear(words: np.ndarray, ids: np.ndarray) -> None:
    ids = ids[ids < 32 * len(words)]
    at, bits = _bits(ids)
    np.bitwise_and.at(words, at, ~bits)
