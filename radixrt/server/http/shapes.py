"""Response bodies and server-sent events in OpenAI's shapes, built from the runtime's results."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from radixrt.client.endpoint import prompt_ids
from radixrt.server.http.reasoning import ReasoningParser, ReasoningStream
from radixrt.structured.tools import ToolCallParser, new_call_id


class Echo(NamedTuple):
    """A completion prompt echoed before its completion (`echo: true`): its text as given, and
    its token ids, which the gateway tokenizes itself so that each echoed logprob has its token
    (the runtime's prompt logprobs are of the ids it was sent)."""

    text: str
    ids: list[int]

    @classmethod
    def of(cls, tokenizer: Any, prompt: str | list[int]) -> Echo:
        """As the runtime tokenizes a text prompt (`prompt_ids`)."""
        if isinstance(prompt, str):
            return cls(prompt, prompt_ids(tokenizer, prompt))
        return cls(tokenizer.decode(prompt), list(prompt))


@dataclass
class ResponseShape:
    """What differs between chat and text completions."""

    chat: bool
    tokenizer: Any
    logprobs: bool
    tool_parser: ToolCallParser | None = None  # set when the reply may hold tool calls
    reasoning: ReasoningParser | None = None  # --reasoning-parser, on chat replies

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def choice(
        self,
        index: int,
        text: str,
        meta: dict[str, Any],
        stream: bool = False,
        called: bool = False,
        echo: Echo | None = None,
    ) -> dict[str, Any]:
        """A finished sample; in a stream its text already went out as deltas (`called`: calls
        among them). A reply with tool calls finishes with `tool_calls`. `echo`: the completion
        prompt, whose text and logprobs come first."""
        if self.chat and not stream:
            message = self._message(text)
            called = "tool_calls" in message
            body: dict[str, Any] = {"message": message}
        elif self.chat:
            body = {"delta": {}}
        else:
            body = {"text": "" if stream else (echo.text if echo else "") + text}
        return {
            "index": index,
            **body,
            "logprobs": self._logprobs(meta, echo) if self.logprobs else None,
            "finish_reason": "tool_calls" if called else meta["finish_reason"]["type"],
        }

    def _message(self, text: str) -> dict[str, Any]:
        """The assistant's message: with a reasoning parser, the reasoning apart; with tools, the
        text before the calls and the calls (a call cut short by the token limit is dropped: it
        would not parse)."""
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            message["reasoning_content"] = reasoning or None
        if self.tool_parser is None:
            return {**message, "content": text}
        scan = self.tool_parser.scan(text, final=True)
        calls = scan.finished_calls()
        if not calls:
            return {**message, "content": scan.content}
        return {
            **message,
            "content": scan.content.strip() or None,
            "tool_calls": [c.to_openai() for c in calls],
        }

    def delta(self, index: int, text: str | dict[str, Any], first: bool = False) -> dict[str, Any]:
        """A streamed piece: text, or a chat delta made elsewhere (`ToolCallStream`)."""
        body: dict[str, Any]
        if isinstance(text, dict):
            body = {"delta": text}
        elif self.chat:
            body = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        else:
            body = {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": None}

    def _logprobs(self, meta: dict[str, Any], echo: Echo | None = None) -> dict[str, Any]:
        """OpenAI's logprobs of a sample, from the runtime's [logprob, token id] pairs."""
        decode = self.tokenizer.decode
        chosen = [(decode([tid]), lp) for lp, tid in meta["output_token_logprobs"]]
        tops = [
            [(decode([tid]), lp) for lp, tid in top] for top in meta.get("output_top_logprobs", [])
        ]
        if self.chat:

            def entry(token: str, logprob: float) -> dict[str, Any]:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {
                "content": [
                    {**entry(*c), "top_logprobs": [entry(*t) for t in top]}
                    for c, top in zip(chosen, tops or [[]] * len(chosen))
                ]
            }
        # the runtime sends top logprobs (perhaps none: max_tokens 0) only when asked for some
        asked_tops = "output_top_logprobs" in meta
        top_dicts: list[dict[str, float] | None] | None = (
            [dict(top) for top in tops] if asked_tops else None
        )
        if echo is not None:
            prompt, prompt_tops = self._prompt_logprobs(meta)
            chosen = prompt + chosen
            top_dicts = prompt_tops + top_dicts if top_dicts is not None else None
        offsets = list(itertools.accumulate((len(t) for t, _ in chosen), initial=0))[:-1]
        return {
            "tokens": [t for t, _ in chosen],
            "token_logprobs": [lp for _, lp in chosen],
            "text_offset": offsets,
            "top_logprobs": top_dicts,
        }

    def _prompt_logprobs(
        self, meta: dict[str, Any]
    ) -> tuple[list[tuple[str, float | None]], list[dict[str, float] | None]]:
        """The echoed prompt's (token, logprob) pairs and top-logprob maps, as OpenAI has them:
        the first token, which nothing predicts, has None for both (the runtime's
        `input_token_logprobs` from position 0 already start so, as SGLang's do)."""
        decode = self.tokenizer.decode
        scored = [(decode([tid]), lp) for lp, tid in meta["input_token_logprobs"]]
        tops = [
            None if top is None else {decode([tid]): lp for lp, tid in top}
            for top in meta.get("input_top_logprobs", [None] * len(scored))
        ]
        return scored, tops


@dataclass
class ToolCallStream:
    """One choice's streamed reply read as it grows: deltas of the content before the calls, then
    each call's first delta (index, id, type, name, empty arguments) and its arguments in pieces."""

    parser: ToolCallParser
    text: str = ""
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    arguments_sent: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The chat deltas this much more text lets out (`final`: the reply is over)."""
        self.text += delta
        scan = self.parser.scan(self.text, final)
        out: list[dict[str, Any]] = []
        if len(scan.content) > self.content_sent and not self.called:
            out.append({"content": scan.content[self.content_sent :]})
            self.content_sent = len(scan.content)
        for i, call in enumerate(scan.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.arguments_sent.append(0)
                function = {"name": call.name, "arguments": ""}
                first = {"index": i, "id": self.ids[i], "type": "function", "function": function}
                out.append({"tool_calls": [first]})
            if piece := call.arguments[self.arguments_sent[i] :]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                self.arguments_sent[i] = len(call.arguments)
        return out


@dataclass
class ChoiceStream:
    """One choice's streamed text as the deltas to send: the reasoning apart (`reasoning_content`)
    when a reasoning parser runs, then the answer as tool-call deltas when tools may be called,
    else as content."""

    reasoning: ReasoningStream | None = None
    calls: ToolCallStream | None = None

    @classmethod
    def of(cls, shape: ResponseShape) -> ChoiceStream:
        return cls(
            ReasoningStream(shape.reasoning) if shape.reasoning else None,
            ToolCallStream(shape.tool_parser) if shape.tool_parser else None,
        )

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, delta: str, final: bool = False) -> list[str | dict[str, Any]]:
        """The deltas (text, or chat delta bodies) this much more text lets out."""
        out: list[str | dict[str, Any]] = []
        content = delta
        if self.reasoning is not None:
            piece = self.reasoning.feed(delta, final)
            if piece.reasoning:
                out.append({"reasoning_content": piece.reasoning})
            content = piece.content
        if self.calls is not None:
            out += self.calls.feed(content, final)
        elif content:
            out.append(content)
        return out


def usage_of(samples: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Usage over prompts (each counted once) and all their samples."""
    firsts = [s[0]["meta_info"] for s in samples]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(
        s["meta_info"]["completion_tokens"] for per_prompt in samples for s in per_prompt
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def response_body(
    shape: ResponseShape,
    rid: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    chunk: bool = False,
) -> dict[str, Any]:
    body = {
        "id": rid,
        "object": shape.chunk_object if chunk else shape.object,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    return body if usage is None else {**body, "usage": usage}


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
