"""A message's prompt as token ids, for the runtime's ops that take one (generate, tokenize,
pin), without stalling the serving loop.

The prompt's size is checked first (`check_prompt_size`: `--max-prompt-bytes`, before anything
is tokenized). `input_ids` and short texts are handled at once. A long text is tokenized by a
worker thread (Hugging Face fast tokenizers run in Rust and release the GIL): tokenizing a text
of the default 4 MiB cap takes seconds, which the loop would otherwise spend not stepping
anyone's requests. The op then answers nothing yet; when the ids are ready the loop dispatches
the same message again and the op finds them here (`ids`), so every check the op makes runs
again against the server's state at that moment.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixrt.client.endpoint import prompt_ids
from radixrt.protocol import ErrorCode, RequestError
from radixrt.server.front import Caller, check_prompt_size

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 16 << 10  # texts up to this are tokenized in the loop (~10-40 ms at most)
MAX_PENDING_TEXTS = 16  # long texts waiting for the worker; past it, 'overloaded'


@dataclass(eq=False)
class PendingText:
    """A message whose text the worker is tokenizing, and who sent it."""

    caller: Caller
    msg: dict[str, Any]
    future: Future[list[int]]


class PromptTokenizer:
    """Token ids of prompts, long texts tokenized off the loop (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_prompt_bytes: int):
        self.tokenizer = tokenizer
        # the worker's own copy: transformers may reset a tokenizer's truncation and padding
        # (a Rust object that two threads must not change at once) before it encodes
        self.worker_tokenizer = copy.deepcopy(tokenizer)
        self.max_prompt_bytes = max_prompt_bytes
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.pending: list[PendingText] = []
        self.ready_ids: dict[int, Future[list[int]]] = {}  # id(msg) -> its tokenized text

    def ids(
        self, caller: Caller, msg: dict[str, Any], add_special_tokens: bool = True
    ) -> list[int] | None:
        """The prompt's token ids: its `input_ids` (checked to be ints) or its `text` tokenized
        (`prompt_ids`: the model's special tokens added unless `add_special_tokens` is False).
        None when a long text has gone to the worker: the message comes back through `ready`.
        ValueError for a malformed prompt, `invalid_request` past `--max-prompt-bytes` (checked
        before any tokenizing), `overloaded` when too many long texts wait."""
        text, ids = msg.get("text"), msg.get("input_ids")
        if (text is None) == (ids is None):
            raise ValueError("give exactly one of text or input_ids")
        check_prompt_size(msg, self.max_prompt_bytes)
        if text is None:
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("input_ids must be a list of ints")
            return ids
        if not isinstance(text, str):
            raise ValueError("text must be a string")
        done = self.ready_ids.get(id(msg))
        if done is not None:
            return done.result()
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return prompt_ids(self.tokenizer, text, add_special_tokens)
        if len(self.pending) >= MAX_PENDING_TEXTS:
            raise RequestError(
                ErrorCode.OVERLOADED,
                f"{len(self.pending)} long texts are waiting to be tokenized; try again later",
            )
        future = self.pool.submit(prompt_ids, self.worker_tokenizer, text, add_special_tokens)
        self.pending.append(PendingText(caller, msg, future))
        return None

    def ready(self) -> Iterator[PendingText]:
        """The messages whose texts are tokenized, each to be dispatched again while it is
        yielded (its ids are then found by `ids`, and forgotten after)."""
        finished = [p for p in self.pending if p.future.done()]
        for p in finished:
            self.pending.remove(p)
            self.ready_ids[id(p.msg)] = p.future
            try:
                yield p
            finally:
                del self.ready_ids[id(p.msg)]

    def forget(self, identities: set[bytes]) -> None:
        """Drop the texts of clients that are gone."""
        for p in [p for p in self.pending if p.caller.identity in identities]:
            p.future.cancel()
            self.pending.remove(p)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
