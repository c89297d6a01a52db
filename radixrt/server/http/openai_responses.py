"""OpenAI's Responses API on the gateway: `POST /v1/responses` (whole, or streamed with the
Responses event types), `GET` and `DELETE /v1/responses/{id}`. A request's items are translated
into a chat completions request and take that path (`Gateway.chat_plan`: the chat template, the
tool constraint, the reasoning split); the reply is read by the chat path's `ChoiceStream` and
its pieces become output items (`ItemStream`), streamed or whole alike.

`previous_response_id` continues a stored response: its input and output items come before the
new input (its `instructions` do not carry over, as OpenAI has it), so the chained prompt starts
with the stored one and is read from the radix cache. Responses are stored unless `store:
false`, per tenant (the caller's key names it), compactly (`Stored`: the body and the items a turn
adds, as JSON bytes, so what the store counts is what it holds), at most MAX_STORED_PER_TENANT
each and `--max-stored-response-bytes-per-tenant` each and `--max-stored-response-bytes` in all
(`ResponseStore`: a chain's every turn counts against its tenant while a stored response
continues it). A continuation's chain is parsed on the CPU pool as a job its size, and a chain
holding more than `--max-prompt-bytes` with the request is refused: reasoning items' encrypted
content is stored, never in the prompt, so the prompt's bound alone did not bound it."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

from radixrt.protocol import ErrorCode
from radixrt.server.http.cpu_pool import CALLER, Caller
from radixrt.server.http.errors import RUNTIME_EXCEPTIONS, APIError, from_runtime_error
from radixrt.server.http.gateway import Gateway, bearer, event_stream, unless_disconnected
from radixrt.server.http.schemas import Body, ChatCompletionRequest, ChatMessage
from radixrt.server.http.shapes import ChoiceStream

MAX_STORED_PER_TENANT = 256
MAX_REASONING_PARTS = 64  # summary or content parts of one reasoning item
# what a stored response holds beside its two byte strings: its record and its index entry
STORED_OVERHEAD_BYTES = 512
RESPONSES_ROUTES = ("/v1/responses",)


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str
    # an output_text sent back: accepted, never stored (they do not reach the prompt)
    annotations: list[Any] | None = Field(None, exclude=True)
    logprobs: list[Any] | None = Field(None, exclude=True)


class UnsupportedPart(BaseModel):
    """Content a text model here cannot take: refused naming its type."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


Part = Annotated[InputText | UnsupportedPart, Field(discriminator="type")]


def _text_as_parts(content: Any) -> Any:
    """A string content is one text part (so a bad part's error names just the part)."""
    return [{"type": "input_text", "text": content}] if isinstance(content, str) else content


class MessageItem(Body):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[Part], BeforeValidator(_text_as_parts)]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class SummaryText(Body):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Body):
    """Reasoning from an earlier reply: not rendered again (chat templates drop it). Its parts
    are text parts, at most MAX_REASONING_PARTS of each kind, so an item is as large as its
    text and no larger (any JSON under `summary` would be kept as Python objects many times
    its size)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list, max_length=MAX_REASONING_PARTS)
    content: list[ReasoningText] | None = Field(None, max_length=MAX_REASONING_PARTS)
    encrypted_content: str | None = None
    status: str | None = None


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]
ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[Item])


def _items(given: Any) -> Any:
    """A string input is one user message; an item without a type is a message (OpenAI's
    "easy" input message)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if isinstance(given, list):
        return [
            {"type": "message", **i} if isinstance(i, dict) and "type" not in i else i
            for i in given
        ]
    return given


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description or ""}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_}}


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class ReasoningConfig(Body):
    """Accepted: the reasoning is the model's (with --reasoning-parser, `reasoning` items)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: Annotated[list[Item], BeforeValidator(_items)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None  # accepted; nothing more is there to include
    # radixrt's own (docs/protocol.md), as on every other route
    cache_salt: str | None = None
    priority: int | None = None
    timeout: float | None = None

    def echo(self) -> dict[str, Any]:
        """The request's settings, as a response repeats them."""
        choice = self.tool_choice
        fmt = (
            self.text.format
            if self.text and self.text.format
            else TextFormat.model_validate({"type": "text"})
        )
        return {
            "instructions": self.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedFunction)
            else choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_output_tokens": self.max_output_tokens,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "metadata": self.metadata or {},
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "truncation": "disabled",
        }


def chat_request(req: ResponsesRequest, items: list[Any]) -> ChatCompletionRequest:
    """The chat completions request that runs `req` over the conversation `items`."""
    choice = req.tool_choice
    messages = (
        [{"role": "system", "content": req.instructions}] if req.instructions else []
    ) + chat_messages(items)
    fmt = req.text.format if req.text else None
    given = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "timeout": req.timeout,
        "response_format": fmt.response_format() if fmt else None,
        "tools": [t.to_openai() for t in req.tools] if req.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, NamedFunction)
        else choice,
    }
    return ChatCompletionRequest(
        model=req.model,
        messages=[ChatMessage(**m) for m in messages],
        parallel_tool_calls=req.parallel_tool_calls is not False,
        **{k: v for k, v in given.items() if v is not None},
    )


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Items as OpenAI chat messages: function calls join the assistant message before them
    (or make one), outputs become `tool` messages; 400 naming an output that answers no call
    before it, or content a text model cannot take."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(where, item)})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise _bad(
                    where,
                    f"function_call_output for call_id {item.call_id!r}, which no "
                    "function_call before it has",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def _text(where: str, item: MessageItem) -> str:
    for j, part in enumerate(item.content):
        if isinstance(part, UnsupportedPart):
            raise _bad(
                f"{where}.content[{j}]",
                f"{part.type} content is not supported: this server serves a text-only model",
            )
    return "".join(p.text for p in item.content if isinstance(p, InputText))


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where, code=ErrorCode.INVALID_REQUEST.value)


@dataclass
class ItemStream:
    """One reply as output items, fed as it grows: the chat path's pieces (reasoning, text,
    tool-call deltas) become `reasoning`, `message` and `function_call` items and the events
    that build them."""

    choice: ChoiceStream
    items: list[dict[str, Any]] = field(default_factory=list)
    open: bool = False

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The events this much more text lets out (`final`: the reply is over; the last item
        is done)."""
        events = [e for piece in self.choice.feed(delta, final) for e in self._piece(piece)]
        if final and self.open:
            events += self._close()
        return events

    def _piece(self, piece: str | dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(piece, str):
            return self._text("message", piece)
        if "reasoning_content" in piece:
            return self._text("reasoning", piece["reasoning_content"])
        if "content" in piece:
            return self._text("message", piece["content"])
        (call,) = piece["tool_calls"]
        if "id" in call:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"]}
            item.update(name=call["function"]["name"], arguments="", status="in_progress")
            return self._start(item)
        item, piece_text = self.items[-1], call["function"]["arguments"]
        item["arguments"] += piece_text
        return [
            {"type": "response.function_call_arguments.delta", **self._at(), "delta": piece_text}
        ]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not (self.open and self.items[-1]["type"] == kind):
            events += self._start(_new_item(kind))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.items[-1]["content"].append(part)
                events.append(
                    {
                        "type": "response.content_part.added",
                        **self._at(),
                        "content_index": 0,
                        "part": dict(part),
                    }
                )
            else:
                self.items[-1]["content"].append({"type": "reasoning_text", "text": ""})
        self.items[-1]["content"][0]["text"] += text
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, list[Any]] = {"logprobs": []} if kind == "message" else {}
        return [*events, {"type": name, **self._at(), "content_index": 0, "delta": text, **extra}]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close() if self.open else []
        self.items.append(item)
        self.open = True
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        return [*events, {**added, "item": json.loads(json.dumps(item))}]

    def _close(self) -> list[dict[str, Any]]:
        self.open = False
        item, at = self.items[-1], self._at()
        item["status"] = "completed"
        events = []
        if item["type"] == "function_call":
            done = {"arguments": item["arguments"], "name": item["name"]}
            events.append({"type": "response.function_call_arguments.done", **at, **done})
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra: dict[str, list[Any]] = {"logprobs": []} if kind == "output_text" else {}
            events.append(
                {
                    "type": f"response.{kind}.done",
                    **at,
                    "content_index": 0,
                    "text": part["text"],
                    **extra,
                }
            )
            if kind == "output_text":
                events.append(
                    {
                        "type": "response.content_part.done",
                        **at,
                        "content_index": 0,
                        "part": dict(part),
                    }
                )
        done = {"type": "response.output_item.done", "output_index": at["output_index"]}
        return [*events, {**done, "item": json.loads(json.dumps(item))}]


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "message":
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant"}
        return {**item, "status": "in_progress", "content": []}
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": []}


@dataclass(eq=False)
class Stored:
    """One stored response, compact: its body and the items its turn adds to the conversation
    (its input, then its output) as JSON bytes, and the stored response it continues
    (`parent`), whose conversation comes first. A response holds its parent alive, so the
    store counts each link of a chain until no stored response continues it (`refs`)."""

    id: str
    body: bytes  # the response as answered
    items: bytes  # ITEMS' JSON: this turn's input and output items
    parent: Stored | None = None
    refs: int = 0  # the store's index entry, and each held response that continues this one

    @classmethod
    def of(cls, body: dict[str, Any], items: list[Any], parent: Stored | None) -> Stored:
        return cls(body["id"], json.dumps(body).encode(), _packed(items), parent)

    @property
    def size(self) -> int:
        """The bytes it holds: what the store's bounds count."""
        return len(self.body) + len(self.items) + STORED_OVERHEAD_BYTES

    def chain(self) -> list[Stored]:
        """Its conversation's responses, the first first, itself last."""
        links: list[Stored] = []
        link: Stored | None = self
        while link is not None:
            links.append(link)
            link = link.parent
        return links[::-1]

    def conversation(self) -> list[Any]:
        """Every item of the chain: the input and output items of each turn, in order."""
        return [item for link in self.chain() for item in ITEMS.validate_json(link.items)]


def _packed(items: list[Any]) -> bytes:
    """Items as the store keeps them: ITEMS' JSON, unset fields left out."""
    return ITEMS.dump_json(items, exclude_none=True)


@dataclass
class TenantStore:
    """One tenant's stored responses by id (the oldest first) and the bytes they hold, with
    the responses their chains keep alive."""

    index: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    bytes: int = 0


@dataclass
class ResponseStore:
    """Stored responses per tenant: at most `per_tenant` of them, holding at most
    `bytes_per_tenant` each (a chain's earlier turns included) and `total_bytes` in all; past
    a bound the oldest go first (past the total, the oldest of the tenant holding the most).
    The newest response of a tenant stays even past `bytes_per_tenant`: `check_room` refuses
    a conversation that would not fit before it runs. Not thread-safe: the gateway's event
    loop is its one user."""

    per_tenant: int = MAX_STORED_PER_TENANT
    bytes_per_tenant: int = 64 << 20
    total_bytes: int = 1 << 30
    tenants: dict[str, TenantStore] = field(default_factory=dict)
    held: int = 0  # bytes, all tenants together

    def check_room(self, parent: Stored | None, items: list[Any]) -> None:
        """400 when a conversation (the chain `parent` ends, then `items`) alone would hold
        more than a tenant's bound: storing it would crowd out everything else and still not fit."""
        chain = parent.chain() if parent else []
        size = len(_packed(items)) + sum(link.size for link in chain)
        if size > self.bytes_per_tenant:
            raise _bad(
                "input",
                f"this conversation would hold {size} bytes in the response store, at most "
                f"{self.bytes_per_tenant} (--max-stored-response-bytes-per-tenant); send "
                "store: false or start a new conversation",
            )

    def put(self, tenant: str, stored: Stored) -> None:
        mine = self.tenants.setdefault(tenant, TenantStore())
        mine.index[stored.id] = stored
        self._hold(mine, stored)
        while len(mine.index) > 1 and (
            len(mine.index) > self.per_tenant or mine.bytes > self.bytes_per_tenant
        ):
            self._drop(tenant, next(iter(mine.index)))
        while self.held > self.total_bytes:
            biggest = max(self.tenants, key=lambda t: self.tenants[t].bytes)
            self._drop(biggest, next(iter(self.tenants[biggest].index)))

    def get(self, tenant: str, rid: str) -> Stored:
        stored = self.tenants.get(tenant, TenantStore()).index.get(rid)
        if stored is None:
            raise APIError(
                404, f"no stored response with id {rid!r}", param="response_id", code="not_found"
            )
        return stored

    def delete(self, tenant: str, rid: str) -> None:
        self.get(tenant, rid)
        self._drop(tenant, rid)

    def _hold(self, mine: TenantStore, link: Stored | None) -> None:
        """One more holder of `link`: counted (and its parent held) when it had none."""
        while link is not None:
            link.refs += 1
            if link.refs > 1:
                return
            mine.bytes += link.size
            self.held += link.size
            link = link.parent

    def _drop(self, tenant: str, rid: str) -> None:
        """Take `rid` out of the index; what no held response continues any more is freed."""
        mine = self.tenants[tenant]
        link: Stored | None = mine.index.pop(rid)
        while link is not None:
            link.refs -= 1
            if link.refs > 0:
                break
            mine.bytes -= link.size
            self.held -= link.size
            link = link.parent
        if not mine.index:
            del self.tenants[tenant]


class ResponsesAPI:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        limits = gateway.limits
        self.store = ResponseStore(
            bytes_per_tenant=limits.max_stored_response_bytes_per_tenant,
            total_bytes=limits.max_stored_response_bytes,
        )

    def tenant(self, request: Request) -> str:
        """Whose store the caller's key opens (the guard has refused a wrong key already)."""
        principal = self.gateway.keys.principal_of(bearer(dict(request.headers.raw)))
        return principal.tenant if principal else ""

    async def create(self, request: Request, req: ResponsesRequest) -> Response:
        tenant = self.tenant(request)
        parent = None
        if req.previous_response_id is not None:
            try:
                parent = self.store.get(tenant, req.previous_response_id)
            except APIError as e:
                raise _bad("previous_response_id", str(e)) from None
        if req.store:
            self.store.check_room(parent, req.input)
        before = await self._history(parent) if parent else []
        model = await self.gateway.model()
        turn = Turn(tenant, req, parent, [*before, *req.input], _head(model.name, req))
        chat = chat_request(req, turn.items)
        plan = await self.gateway.chat_plan(model, chat)
        options = await self.gateway.options(request, chat)
        stream = ItemStream(ChoiceStream.of(plan.shape))
        endpoint = self.gateway.endpoint
        if not req.stream:
            generate = endpoint.async_generate(plan.prompt, plan.params, options=options)
            (sample,) = await unless_disconnected(request, [generate])
            assert isinstance(sample, dict), "one prompt, one sample"
            stream.feed(sample["text"], final=True)
            return JSONResponse(self._finish(turn, stream, sample["meta_info"]))
        return await event_stream(
            request,
            lambda: endpoint.async_stream(plan.prompt, plan.params, options=options),
            lambda replies: self._events(turn, stream, replies),
        )

    async def _history(self, parent: Stored) -> list[Any]:
        """The items before this turn's input: the conversation `parent` ends, parsed on the
        CPU pool as a job the size of the bytes it parses (a 120-byte continuation of a 56 MB
        chain is heavy work, never the event loop's). 400 when the chain and this request hold
        more than --max-prompt-bytes: a continuation costs what its conversation holds, which a
        prompt's bound bounds, reasoning items' encrypted content (never in the prompt) too."""
        caller = CALLER.get()
        held = sum(len(link.items) for link in parent.chain()) + caller.body_bytes
        bound = self.gateway.limits.max_prompt_bytes
        if held > bound:
            raise _bad(
                "previous_response_id",
                f"the conversation holds {held} bytes with this request, at most {bound} "
                "(--max-prompt-bytes); start a new conversation",
            )
        token = CALLER.set(Caller(caller.tenant, held))
        try:
            return await self.gateway.cpu.run(parent.conversation)
        finally:
            CALLER.reset(token)

    def _finish(self, turn: Turn, stream: ItemStream, meta: dict[str, Any]) -> dict[str, Any]:
        """The finished response, stored unless `store: false`. An aborted request
        (`/abort_request`) is an APIError (499)."""
        finish = meta["finish_reason"]
        if finish["type"] == "abort":
            message = finish.get("message") or "the request was aborted"
            raise APIError(499, message, "api_error", code=ErrorCode.ABORTED.value)
        cut = finish["type"] == "length"
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
        body = {
            **turn.head,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": stream.items,
            "usage": usage,
        }
        if turn.req.store:
            output = ResponsesRequest.model_validate(
                {"input": [_as_input(i) for i in stream.items]}
            ).input
            self.store.put(turn.tenant, Stored.of(body, [*turn.req.input, *output], turn.parent))
        return body

    async def _events(
        self, turn: Turn, stream: ItemStream, replies: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[str]:
        """response.created, response.in_progress, the items' events, then response.completed
        (or response.incomplete, cut by max_output_tokens); a failure midway is one `error`
        event. Every event carries its `sequence_number`."""
        numbers = itertools.count()

        def sse(event: dict[str, Any]) -> str:
            data = json.dumps({**event, "sequence_number": next(numbers)})
            return f"event: {event['type']}\ndata: {data}\n\n"

        yield sse({"type": "response.created", "response": turn.head})
        yield sse({"type": "response.in_progress", "response": turn.head})
        try:
            async for reply in replies:
                finished = reply["finished"]
                for event in stream.feed("" if finished else reply["delta"], final=finished):
                    yield sse(event)
                if finished:
                    body = self._finish(turn, stream, reply["meta_info"])
        except (*RUNTIME_EXCEPTIONS, APIError) as e:
            error = e if isinstance(e, APIError) else from_runtime_error(e)
            yield sse({"type": "error", "code": error.code, "message": str(error), "param": None})
            return
        yield sse({"type": f"response.{body['status']}", "response": body})


@dataclass(frozen=True)
class Turn:
    """One response being made: whose, what was asked, the stored response it continues, the
    conversation (that response's, then the input), and the response's fields before its
    output."""

    tenant: str
    req: ResponsesRequest
    parent: Stored | None
    items: list[Any]
    head: dict[str, Any]


def _head(model: str, req: ResponsesRequest) -> dict[str, Any]:
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "usage": None,
        **req.echo(),
    }


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item it is in the next turn."""
    if item["type"] == "message":
        return {
            **item,
            "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]],
        }
    return item


def add_responses_routes(app: FastAPI, gateway: Gateway) -> None:
    api = ResponsesAPI(gateway)

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Response:
        return await api.create(request, req)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        body = api.store.get(api.tenant(request), response_id).body
        return Response(body, media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        api.store.delete(api.tenant(request), response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
