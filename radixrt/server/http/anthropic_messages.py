"""Anthropic's Messages API on the gateway: `POST /v1/messages` (whole, or streamed with
Anthropic's events) and `POST /v1/messages/count_tokens`. A body is translated into a chat
completions request, so that it takes the chat path itself (`Gateway.chat_plan`): the model's
chat template, the same always-parsing tool constraint, the same reasoning split; errors on these
routes are in Anthropic's shape.

Every field is honoured, accepted knowingly and ignored (`metadata`, `cache_control`: the radix
tree caches every prefix anyway, `service_tier`, `output_config.effort`), or refused by name;
content blocks a text model cannot take (images, documents, server tools' blocks) are refused
naming the block.

A reply is read once, as it streams or whole, by the chat path's own `ChoiceStream` (reasoning
apart, then text or tool calls); `BlockStream` turns its pieces into content blocks and their
events, so a streamed reply's blocks are the whole reply's, piece for piece."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from radixrt.client.endpoint import RequestOptions, prompt_ids
from radixrt.protocol import ErrorCode
from radixrt.server.http.errors import RUNTIME_EXCEPTIONS, APIError, from_runtime_error
from radixrt.server.http.gateway import ChatPlan, Gateway, event_stream, unless_disconnected
from radixrt.server.http.schemas import Body, ChatCompletionRequest, ChatMessage
from radixrt.server.http.shapes import ChoiceStream

# what a model without the reasoning parser gets asked, where its template reads it (Qwen3's)
_THINKING_SWITCH = re.compile(r"\benable_thinking\b")


class CacheControl(Body):
    """Anthropic's prompt-caching marker: accepted, and needless (every prefix is cached)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class UnsupportedBlock(BaseModel):
    """A block Anthropic defines that a text model here cannot take: refused naming its type."""

    model_config = ConfigDict(extra="allow")
    type: Literal[
        "image",
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
    ]


ResultPart = Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool = False  # accepted; the result's text says what went wrong
    cache_control: CacheControl | None = None


class ThinkingBlock(Body):
    """Reasoning from an earlier reply: not rendered again (chat templates drop old reasoning)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | UnsupportedBlock,
    Field(discriminator="type"),
]


def _text_as_blocks(content: Any) -> Any:
    """A string content is one text block (so a bad block's error names just the block)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class Message(Body):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_text_as_blocks)]


class ToolSpec(Body):
    """A client tool: its arguments' JSON schema is `input_schema`. Server tools (web search,
    code execution, ...) have other fields and are refused by name."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoiceSpec(Body):
    """auto (the default with tools), any (some tool must be called), tool (that one), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def to_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            if self.name is None:
                raise _bad("tool_choice", '{"type": "tool"} needs a name')
            return {"type": "function", "function": {"name": self.name}}
        if self.name is not None:
            raise _bad("tool_choice", f"{self.type!r} takes no name")
        return "required" if self.type == "any" else self.type


class ThinkingSpec(Body):
    """`enabled`/`adaptive`: the reply's reasoning comes back as `thinking` blocks (where the
    server runs a reasoning parser); `disabled`: a template with an `enable_thinking` switch is
    told so. `budget_tokens` bounds the reasoning (`max_reasoning_tokens`, at most `max_tokens`)
    where the server runs a reasoning parser, and is accepted and unused where it does not."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class Metadata(Body):
    user_id: str | None = None  # accepted and ignored


class JsonOutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    """Structured output: the reply's text decodes under `format`'s JSON schema."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored


class MessagesPrompt(Body):
    """What makes the prompt: the fields `count_tokens` takes, and `create` too."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: ThinkingSpec | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted and ignored
    # radixrt's own (docs/protocol.md), as on every other route
    cache_salt: str | None = None
    priority: int | None = None
    timeout: float | None = None


def chat_request(
    req: MessagesPrompt, template: str | None, reasoning: bool = False
) -> ChatCompletionRequest:
    """The chat completions request that runs `req`: its history as OpenAI messages (tool_use
    blocks as `tool_calls`, tool_result blocks as `tool` messages), its tools and tool_choice,
    and, when the last message is the assistant's, a reply that continues it (Anthropic's
    prefill). 400 naming the block for a block in the wrong place or a tool_result that answers
    no tool_use of the message before it. `reasoning`: the server runs a reasoning parser, so
    a thinking budget bounds the reasoning."""
    sampling: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        budget = (
            req.thinking.budget_tokens if req.thinking and req.thinking.type == "enabled" else None
        )
        sampling = {
            "max_reasoning_tokens": min(budget, req.max_tokens) if reasoning and budget else None,
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "cache_salt": req.cache_salt,
            "priority": req.priority,
            "timeout": req.timeout,
        }
    fmt = req.output_config.format if req.output_config else None
    choice = req.tool_choice
    return ChatCompletionRequest(
        model=req.model,
        messages=[ChatMessage(**m) for m in chat_messages(req)],
        tools=[t.to_openai() for t in req.tools] if req.tools else None,
        tool_choice=choice.to_openai() if choice else None,
        parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
        response_format={"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
        if fmt
        else None,
        continue_final_message=req.messages[-1].role == "assistant",
        chat_template_kwargs=_thinking_switch(req.thinking, template),
        **{k: v for k, v in sampling.items() if v is not None},
    )


def _bad(where: str, message: str) -> APIError:
    """A 400 (`invalid_request`) about the field or block at `where`."""
    return APIError(400, f"{where}: {message}", param=where, code=ErrorCode.INVALID_REQUEST.value)


def _thinking_switch(thinking: ThinkingSpec | None, template: str | None) -> dict[str, Any]:
    if thinking is None or template is None or not _THINKING_SWITCH.search(template):
        return {}
    return {"enable_thinking": thinking.type != "disabled"}


def chat_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    """The system prompt and messages as OpenAI chat messages. Consecutive messages of one role
    are one turn (as Anthropic combines them)."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _joined(req.system)
        out.append({"role": "system", "content": system})
    turns = _turns(req.messages)
    calls: set[str] = set()  # the tool_use ids of the assistant turn before
    for n, (where, role, blocks) in enumerate(turns):
        if role == "assistant":
            out.append(_assistant_message(where, blocks, last=n == len(turns) - 1))
            calls = {b.id for _, b in blocks if isinstance(b, ToolUseBlock)}
        else:
            out += _user_messages(where, blocks, calls)
            calls = set()
    return out


def _turns(messages: list[Message]) -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """Messages grouped into turns: (where the turn starts, role, its blocks each with where it
    is, e.g. `messages[2].content[0]`)."""
    turns: list[tuple[str, str, list[tuple[str, Any]]]] = []
    for i, m in enumerate(messages):
        blocks = [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(m.content)]
        if turns and turns[-1][1] == m.role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((f"messages[{i}]", m.role, blocks))
    return turns


def _refuse(where: str, block: Any, role: str) -> APIError:
    """A block this server cannot take, or one in a message of the wrong role."""
    if isinstance(block, UnsupportedBlock):
        why = "this server serves a text-only model and its own tools only"
        return _bad(where, f"{block.type} blocks are not supported: {why}")
    return _bad(where, f"a {block.type} block cannot be in a {role} message")


def _assistant_message(where: str, blocks: list[tuple[str, Any]], last: bool) -> dict[str, Any]:
    text, calls = [], []
    for at, block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            raise _refuse(at, block, "assistant")
    if calls and last:
        raise _bad(where, "tool_use blocks need tool_result blocks in a user message after them")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    return {**message, "tool_calls": calls} if calls else message


def _user_messages(
    where: str, blocks: list[tuple[str, Any]], calls: set[str]
) -> list[dict[str, Any]]:
    """A user turn: each tool_result a `tool` message (answering one of `calls`, the tool_use
    ids of the assistant turn before), the text blocks between them one user message each."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    answered: set[str] = set()
    for at, block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise _bad(
                    at,
                    f"tool_result answers tool_use_id {block.tool_use_id!r}, which no tool_use "
                    "block of the assistant message before it has",
                )
            if text:
                out.append({"role": "user", "content": "\n\n".join(text)})
                text = []
            answered.add(block.tool_use_id)
            content = _result_text(at, block)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise _refuse(at, block, "user")
    if calls - answered:
        missing = sorted(calls - answered)
        raise _bad(where, f"tool_use ids {missing} have no tool_result block in this message")
    if text:
        out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _result_text(where: str, block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    for j, part in enumerate(block.content):
        if isinstance(part, UnsupportedBlock):
            raise _refuse(f"{where}.content[{j}]", part, "tool_result")
    return _joined(block.content)


def _joined(blocks: list[Any]) -> str:
    return "\n\n".join(b.text for b in blocks)


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
        assert isinstance(sample, dict), "one prompt, one sample"
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
        return await event_stream(
            request,
            lambda: self.gateway.endpoint.async_stream(plan.prompt, plan.params, options=options),
            lambda replies: self._events(replies, plan, head, max_tokens),
        )

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
        ids = await self.gateway.cpu.run(prompt_ids, model.tokenizer, plan.prompt)
        return {"input_tokens": len(ids)}


def add_messages_routes(app: FastAPI, gateway: Gateway) -> None:
    api = MessagesAPI(gateway)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Response:
        return await api.create(request, req)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: MessagesPrompt) -> dict[str, Any]:
        return await api.count_tokens(req)
