"""`--reasoning-parser`: the `<think>…</think>` block of a reasoning model's reply, split from the
answer into `reasoning_content`, whole or as the reply streams (model-free: text in, text out).

SGLang's semantics: `deepseek-r1` reads the reply as reasoning from its first character (the chat
template opened the block; a `<think>` the model writes itself is dropped), until `</think>`;
`qwen3` reads reasoning only when the reply starts with `<think>` (leading whitespace aside).
Either way a reply whose block never closes is all reasoning. Reasoning is stripped of the
whitespace around it and the answer of the whitespace before it. A stream holds back what may
still change (a tag split across deltas, whitespace that may end the reasoning), so its pieces
join to exactly the whole reply's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from radixrt.structured.reasoning import OPENS_THINKING, THINK_END, THINK_START


class ReasoningSplit(NamedTuple):
    """A reply (or the certain part of a reply so far) as reasoning and answer text."""

    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    """`opens_thinking`: the chat template opened the block, so the reply starts inside it."""

    name: str
    opens_thinking: bool

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        """The reply `text` split; with `final=False` (a reply still growing), only what no
        further text can change, so each later split extends this one."""
        body = text.lstrip()
        if body.startswith(THINK_START):
            body = body[len(THINK_START) :]
        elif not final and THINK_START.startswith(body):
            return ReasoningSplit("", "")  # nothing yet, or maybe the start of <think>
        elif not self.opens_thinking:
            return ReasoningSplit("", text)
        reasoning, end, content = body.partition(THINK_END)
        if end:
            return ReasoningSplit(reasoning.strip(), content.lstrip())
        if final:
            return ReasoningSplit(reasoning.strip(), "")
        return ReasoningSplit(reasoning[: len(reasoning) - _partial_end(reasoning)].strip(), "")


def _partial_end(text: str) -> int:
    """The length of the longest end of `text` that `</think>` starts with."""
    for n in range(min(len(text), len(THINK_END) - 1), 0, -1):
        if THINK_END.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {name: ReasoningParser(name, opens) for name, opens in OPENS_THINKING.items()}


@dataclass
class ReasoningStream:
    """One choice's reply read as it streams: each delta in, the new reasoning and answer out."""

    parser: ReasoningParser
    text: str = ""
    sent: ReasoningSplit = ReasoningSplit("", "")

    def feed(self, delta: str, final: bool = False) -> ReasoningSplit:
        """The reasoning and answer text this delta lets out (`final`: the reply is over)."""
        self.text += delta
        now = self.parser.split(self.text, final)
        new = ReasoningSplit(
            now.reasoning[len(self.sent.reasoning) :], now.content[len(self.sent.content) :]
        )
        self.sent = now
        return new
