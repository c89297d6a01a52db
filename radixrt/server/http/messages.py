"""Anthropic's Messages API on the gateway: `POST /v1/messages` (whole, or streamed with
Anthropic's events) and `POST /v1/messages/count_tokens`, run through the chat completions path
(anthropic.py translates the body, `Gateway.chat_plan` builds the prompt and constraint), and
errors on these routes in Anthropic's shape.

A reply is read once, as it streams or whole, by the chat path's own `ChoiceStream` (reasoning
apart, then text or tool calls); `BlockStream` turns its pieces into content blocks and their
events, so a streamed reply's blocks are the whole reply's, piece for piece."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixrt.client.endpoint import RequestOptions
from radixrt.protocol import ErrorCode
from radixrt.server.http.anthropic import MessagesPrompt, MessagesRequest, chat_request
from radixrt.server.http.errors import RUNTIME_EXCEPTIONS, APIError, from_runtime_error
from radixrt.server.http.gateway import ChatPlan, Gateway, prepend, unless_disconnected
from radixrt.server.http.responses import ChoiceStream

MESSAGES_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status (anything else: api_error)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def speaks_anthropic(path: str) -> bool:
    return path in MESSAGES_ROUTES


def anthropic_error_body(e: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's shape, with the runtime's
    stable `code` beside them when there is one."""
    kind = "overloaded_error" if e.kind == "overloaded_error" else _ERROR_TYPES.get(e.status)
    error = {"type": kind or "api_error", "message": str(e)}
    return {"type": "error", "error": {**error, "code": e.code} if e.code else error}


def error_response(path: str, e: APIError) -> JSONResponse:
    """The error in the shape of the API `path` belongs to (Anthropic's or OpenAI's)."""
    if not speaks_anthropic(path):
        return e.response()
    headers = None if e.retry_after is None else {"Retry-After": str(e.retry_after)}
    return JSONResponse(anthropic_error_body(e), status_code=e.status, headers=headers)


@dataclass
class BlockStream:
    """One reply as Anthropic content blocks, fed as it grows: the chat path's pieces (reasoning,
    text, tool-call deltas) become `thinking`, `text` and `tool_use` blocks and the events that
    build them (`content_block_start`, `content_block_delta`, `content_block_stop`)."""

    choice: ChoiceStream
    content: list[dict[str, Any]] = field(default_factory=list)
    inputs: dict[int, str] = field(default_factory=dict)  # tool_use block -> its JSON so far
    open: bool = False

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The events this much more text lets out (`final`: the reply is over; the last block
        closes)."""
        events = [e for piece in self.choice.feed(delta, final) for e in self._piece(piece)]
        if final and self.open:
            events.append(self._close())
        return events

    def blocks(self) -> list[dict[str, Any]]:
        """The reply's content: tool_use inputs parsed; a call cut short (by max_tokens) is
        dropped, as it would not parse."""
        out = []
        for i, block in enumerate(self.content):
            if block["type"] == "tool_use":
                try:
                    block = {**block, "input": json.loads(self.inputs[i])}
                except ValueError:
                    continue
            out.append(block)
        return out

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks())

    def _piece(self, piece: str | dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(piece, str):
            return self._text("text", piece)
        if "reasoning_content" in piece:
            return self._text("thinking", piece["reasoning_content"])
        if "content" in piece:
            return self._text("text", piece["content"])
        (call,) = piece["tool_calls"]
        if "id" in call:
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "input": {}}
            events = self._start({**block, "name": call["function"]["name"]})
            self.inputs[len(self.content) - 1] = ""
            return events
        arguments = call["function"]["arguments"]
        self.inputs[len(self.content) - 1] += arguments
        return [self._delta({"type": "input_json_delta", "partial_json": arguments})]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not (self.open and self.content[-1]["type"] == kind):
            empty = {"type": "text", "text": ""} if kind == "text" else _EMPTY_THINKING
            events += self._start(dict(empty))
        self.content[-1][kind] += text
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open block, open `block` (the event holds a copy: the block grows)."""
        events = [self._close()] if self.open else []
        self.content.append(block)
        self.open = True
        index = len(self.content) - 1
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return [*events, start]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> dict[str, Any]:
        self.open = False
        return {"type": "content_block_stop", "index": len(self.content) - 1}


_EMPTY_THINKING = {"type": "thinking", "thinking": "", "signature": ""}


@dataclass(frozen=True)
class Ending:
    """Why and how a reply ended, in Anthropic's terms, and its usage. `input_tokens` counts the
    prompt tokens the radix cache did not have (Anthropic's meaning: the prompt is
    input + cache_read + cache_creation tokens; the tree caches every prefix as it goes, so
    nothing is billed as a cache write)."""

    stop_reason: str
    stop_sequence: str | None
    usage: dict[str, int]

    @classmethod
    def of(cls, meta: dict[str, Any], called: bool, max_tokens: int) -> Ending:
        """`called`: the reply holds a whole tool call. An aborted request (`/abort_request`)
        is an APIError (499)."""
        finish = meta["finish_reason"]
        matched = finish.get("matched")
        if finish["type"] == "abort":
            message = finish.get("message") or "the request was aborted"
            raise APIError(499, message, "api_error", code=ErrorCode.ABORTED.value)
        if finish["type"] == "length":
            # the context filled up before max_tokens did
            short = meta["completion_tokens"] < max_tokens
            reason, sequence = "model_context_window_exceeded" if short else "max_tokens", None
        elif called:
            reason, sequence = "tool_use", None
        elif isinstance(matched, str):
            reason, sequence = "stop_sequence", matched
        else:
            reason, sequence = "end_turn", None
        cached = meta["cached_tokens"]
        usage = {
            "input_tokens": meta["prompt_tokens"] - cached,
            "output_tokens": meta["completion_tokens"],
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }
        return cls(reason, sequence, usage)

    def fields(self) -> dict[str, Any]:
        """The message's `stop_reason`, `stop_sequence` and `usage`."""
        return {
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }


def sse(event: dict[str, Any]) -> str:
    """One of Anthropic's server-sent events: its type is the event name too."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class MessagesAPI:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def create(self, request: Request, req: MessagesRequest) -> Response:
        model = await self.gateway.model()
        chat = chat_request(req, model.template, self.gateway.reasoning is not None)
        plan = await self.gateway.chat_plan(model, chat)
        options = await self.gateway.options(request, chat)
        head = self._head(model.name)
        if req.stream:
            return await self._stream(request, plan, options, head, req.max_tokens)
        generate = self.gateway.endpoint.async_generate(plan.prompt, plan.params, options=options)
        (sample,) = await unless_disconnected(request, [generate])
        blocks = BlockStream(ChoiceStream.of(plan.shape))
        blocks.feed(sample["text"], final=True)
        ending = Ending.of(sample["meta_info"], blocks.called, req.max_tokens)
        body = {**head, "content": blocks.blocks(), **ending.fields()}
        return JSONResponse(body)

    @staticmethod
    def _head(model: str) -> dict[str, Any]:
        """A reply before its content: `message_start`'s message."""
        return {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    async def _stream(
        self,
        request: Request,
        plan: ChatPlan,
        options: RequestOptions,
        head: dict[str, Any],
        max_tokens: int,
    ) -> StreamingResponse:
        try:
            replies = self.gateway.endpoint.async_stream(plan.prompt, plan.params, options=options)
        except RUNTIME_EXCEPTIONS as e:  # it cannot be sent (packed past the frame limit, ...)
            raise from_runtime_error(e) from e
        # the first reply before the headers, so a refused request gets its 4xx
        (first,) = await unless_disconnected(request, [replies.__anext__()])
        events = self._events(prepend(first, replies), plan, head, max_tokens)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(
        self,
        replies: AsyncIterator[dict[str, Any]],
        plan: ChatPlan,
        head: dict[str, Any],
        max_tokens: int,
    ) -> AsyncIterator[str]:
        """message_start, ping, the blocks' events, message_delta (stop reason, usage),
        message_stop; a failure midway is one `error` event."""
        yield sse({"type": "message_start", "message": head})
        yield sse({"type": "ping"})
        blocks = BlockStream(ChoiceStream.of(plan.shape))
        try:
            async for reply in replies:
                finished = reply["finished"]
                for event in blocks.feed("" if finished else reply["delta"], final=finished):
                    yield sse(event)
                if finished:
                    ending = Ending.of(reply["meta_info"], blocks.called, max_tokens)
        except RUNTIME_EXCEPTIONS as e:
            yield sse(anthropic_error_body(from_runtime_error(e)))
            return
        except APIError as e:  # aborted
            yield sse(anthropic_error_body(e))
            return
        fields = ending.fields()
        usage = fields.pop("usage")
        yield sse({"type": "message_delta", "delta": fields, "usage": usage})
        yield sse({"type": "message_stop"})

    async def count_tokens(self, req: MessagesPrompt) -> dict[str, int]:
        """The prompt's tokens as the runtime counts them (Anthropic's `input_tokens` of a
        request with nothing cached)."""
        model = await self.gateway.model()
        plan = await self.gateway.chat_plan(model, chat_request(req, model.template))
        ids = await self.gateway.cpu.run(
            model.tokenizer.encode, plan.prompt, add_special_tokens=False
        )
        return {"input_tokens": len(ids)}


def add_messages_routes(app: FastAPI, gateway: Gateway) -> None:
    api = MessagesAPI(gateway)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Response:
        return await api.create(request, req)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: MessagesPrompt) -> dict[str, Any]:
        return await api.count_tokens(req)
