"""`Gateway`: the steps every HTTP API shares, as a client of the runtime like any other (through
a `ZmqEndpoint`): a request's options (key, adapter, deadline), a chat's plan
(`chat_plan`: prompt, sampling params and reply shape, which the chat, Messages and Responses
APIs all take), the wait that ends when the client leaves (`unless_disconnected`) and the stream
(`event_stream`); the model, adapter and pin bookkeeping, health and metrics. Each API is a
module over it (`openai_chat`, `openai_responses`, `openai_embeddings`, `anthropic_messages`,
`sglang_native`, `control`); `app.build_app` assembles them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from radixrt.client.endpoint import (
    Prompt,
    RequestOptions,
    ZmqEndpoint,
    import_tokenizer_library,
    load_tokenizer,
)
from radixrt.config import GatewaySettings
from radixrt.protocol import ErrorCode, ListLoraAdapters, option_fields
from radixrt.server.http.cpu_pool import CpuPool
from radixrt.server.http.errors import RUNTIME_EXCEPTIONS, APIError, from_runtime_error
from radixrt.server.http.pins import PinLease, PinLeases
from radixrt.server.http.reasoning import REASONING_PARSERS
from radixrt.server.http.schemas import (
    ChatCompletionRequest,
    ChatRendering,
    ChatTools,
    add_constraint,
    chat_job,
    constraint_params,
    message_dict,
)
from radixrt.server.http.shapes import (
    ResponseShape,
)
from radixrt.server.http.template_pool import TemplatePool, worker_memory_bytes
from radixrt.server.metrics import GatewayGauges, GatewayMetrics
from radixrt.server.tenants import KeyRing
from radixrt.structured.tools import ToolCallParser, resolve_parser

# how often a waiting non-streamed request checks that its client is still there
DISCONNECT_POLL_S = 0.25
HEALTH_TIMEOUT_S = 5.0
# how long past a request's timeout the gateway still waits for the runtime's own `timeout`
# reply before it answers 504 itself (a runtime that never answers: stopped, or a lost frame)
REPLY_GRACE_S = 5.0
# the routes app.build_app serves over a Gateway (beside the native ones), by name in the metrics
OPENAI_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/metrics",
)


T = TypeVar("T")


async def unless_disconnected(request: Request, coros: list[Awaitable[T]]) -> list[T]:
    """Await the coroutines; cancel them all (which aborts their runtime requests) when one fails
    or the client goes away."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        while True:
            done, pending = await asyncio.wait(
                tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                if (error := task.exception()) is not None:
                    raise (
                        from_runtime_error(error)
                        if isinstance(error, RUNTIME_EXCEPTIONS)
                        else error
                    )
            if not pending:
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection", "client_disconnected")
    finally:
        for task in tasks:
            task.cancel()


Replies = AsyncIterator[dict[str, Any]]


async def _prepend(first: dict[str, Any], rest: Replies) -> Replies:
    yield first
    async for reply in rest:
        yield reply


async def event_stream(
    request: Request, start: Callable[[], Replies], events: Callable[[Replies], AsyncIterator[str]]
) -> StreamingResponse:
    """Every API's stream: the server-sent events `events` makes of the replies `start()`
    streams, sent once the first reply has come, so that a request the runtime refuses (or that
    cannot be sent: packed past the frame limit, ...) gets its 4xx, not a 200 with an error
    event; the client leaving before then cancels it."""
    try:
        replies = start()
    except RUNTIME_EXCEPTIONS as e:
        raise from_runtime_error(e) from e
    (first,) = await unless_disconnected(request, [replies.__anext__()])
    return StreamingResponse(events(_prepend(first, replies)), media_type="text/event-stream")


@dataclass
class Model:
    name: str
    context_length: int
    tokenizer: Any
    template: str | None
    tool_parser: ToolCallParser  # how this model writes tool calls (--tool-call-parser)
    lora_enabled: bool  # adapters are served: `model` names one, or the served model
    embedding: dict[str, Any] | None  # --is-embedding: the pooling (model_info's)


@dataclass(frozen=True)
class ChatPlan:
    """A chat request ready for the runtime: its prompt text, its sampling params, and how its
    reply reads back (reasoning, tool calls)."""

    prompt: str
    params: dict[str, Any]
    shape: ResponseShape


@dataclass(frozen=True)
class ChatInput:
    """A chat request before its template runs: the render job (`chat_render.RenderJob`, as
    JSON), its sampling params and reply shape."""

    job: bytes
    params: dict[str, Any]
    shape: ResponseShape


# The most generate requests one HTTP call may fan out to (prompts x n): one call must not fill
# the queue that every client shares.
MAX_FANOUT = 256


class Gateway:
    def __init__(
        self,
        endpoint: ZmqEndpoint,
        keys: KeyRing | None = None,
        tool_call_parser: str = "auto",
        limits: GatewaySettings | None = None,
        reasoning_parser: str | None = None,
    ):
        """`limits`: the body (and frame) cap, the request timeout and the pin lease (serve's
        defaults when None); `endpoint` should wait no longer than the request timeout plus
        REPLY_GRACE_S (run_gateway builds it so)."""
        self.endpoint = endpoint
        self.reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.limits = limits or GatewaySettings()
        self.pins = PinLeases(self.limits.http_pin_lease)
        self.cpu = CpuPool(self.limits.http_cpu_threads)
        self.templates = TemplatePool(
            self.limits.http_cpu_threads,
            self.limits.chat_template_timeout,
            worker_memory_bytes(self.limits.max_frame_bytes, self.limits.max_prompt_bytes),
        )
        self.keys = keys or KeyRing()
        self.tool_call_parser = tool_call_parser
        self.metrics = GatewayMetrics()
        self.started = int(time.time())
        self._model: Model | None = None
        self._model_lock = asyncio.Lock()

    async def model(self) -> Model:
        # Loaded once, from start-up on (see build_app): the runtime answers once `serve` runs its loop.
        async with self._model_lock:
            if self._model is None:
                # the tokenizer's library imports (seconds) while the runtime still loads
                info, _ = await asyncio.gather(
                    asyncio.to_thread(lambda: self.endpoint.model_info),
                    asyncio.to_thread(import_tokenizer_library),
                )
                self._model = await asyncio.to_thread(self._load_model, info)
        return self._model

    def _load_model(self, info: dict[str, Any]) -> Model:
        tokenizer = load_tokenizer(info)
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        parser = resolve_parser(self.tool_call_parser, template)
        if template is not None:
            self.templates.start()  # warm before the first chat
        return Model(
            info["model"],
            info["context_length"],
            tokenizer,
            template,
            parser,
            bool(info.get("lora_enabled")),
            info.get("embedding"),
        )

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        return self.keys.principal_of(bearer(headers)) is not None

    def authorized_admin(self, headers: dict[bytes, bytes]) -> bool:
        """/metrics shows every tenant: with keys configured, only the admin key may read it."""
        principal = self.keys.principal_of(bearer(headers))
        return principal is not None and principal.admin

    async def options(self, request: Request, req: BaseModel) -> RequestOptions:
        """A request's options from its body: the request fields it has (`GenerateOptions`;
        one a body lacks, as an agent API's may, is not sent; the native route sets the
        per-prompt ones of each prompt over these, `NativeCall.with_own`), the client's own key
        (the runtime names its tenant) and the adapter its `model` names (vLLM's convention:
        the served model's name, or no `model`, is the base model). The timeout is the body's,
        at most the gateway's (`--http-request-timeout`): the runtime ends the request then,
        before the gateway stops waiting for it."""
        key = bearer(dict(request.headers.raw)) if self.keys.keys else None
        lora = await self.adapter_named(getattr(req, "model", None))  # native bodies have none
        body: dict[str, Any] = {f.name: getattr(req, f.name, None) for f in option_fields()}
        bound = self.limits.http_request_timeout
        timeout = bound if body.get("timeout") is None else min(body["timeout"], bound)
        fields = {**body, "timeout": timeout, "lora_path": lora}
        return RequestOptions(**fields, api_key=key or None)

    async def adapter_named(self, name: str | None) -> str | None:
        """The adapter `model` names, None for the base model. Where adapters are served, `name`
        must be the served model's (or absent) or a loaded adapter's (asked of the runtime each
        time: adapters load and unload at run time); any other is a 404 `model_not_found`, as
        vLLM answers it: a misspelled or unloaded adapter must not be served by the base model.
        Where none are, any name is the base model, as SGLang serves it (clients send their
        own names for the one model)."""
        model = await self.model()
        if not model.lora_enabled or not name or name == model.name:
            return None
        adapters = [a["name"] for a in await asyncio.to_thread(self.endpoint.list_lora_adapters)]
        if name in adapters:
            return name
        raise APIError(
            404,
            f"the model {name!r} does not exist: this server serves {model.name!r}"
            + (f" and the adapters {adapters}" if adapters else " and no adapter now"),
            param="model",
            code="model_not_found",
        )

    def check_prompt_bytes(self, size: int, param: str) -> None:
        """400 for a prompt over `--max-prompt-bytes` (as the runtime would refuse it), before the
        gateway tokenizes or sends it."""
        bound = self.limits.max_prompt_bytes
        if size > bound:
            raise APIError(
                400,
                f"the prompt is {size} bytes; at most {bound} (--max-prompt-bytes)",
                param=param,
                code=ErrorCode.INVALID_REQUEST.value,
            )

    async def chat_plan(self, model: Model, req: ChatCompletionRequest) -> ChatPlan:
        """A chat request as the runtime runs it: the prompt (the messages and tools through the
        model's chat template, at most `--max-prompt-bytes`), the sampling params (with the
        response_format or tool constraint) and how the reply reads back. Every API that speaks
        chat (Anthropic's Messages too) comes through here: the tools' schemas and the render
        job on the CPU pool, the template in a process of the template pool, which stops it
        past `--chat-template-timeout`. 400 for what cannot be rendered or constrained."""
        ready = await self.cpu.run(self._chat_plan, model, req)
        # the template runs in a render process, bounded in time and output (template_pool.py)
        prompt = await self.templates.render(ready.job)
        return ChatPlan(prompt, ready.params, ready.shape)

    def _chat_plan(self, model: Model, req: ChatCompletionRequest) -> ChatInput:
        if model.template is None:
            raise APIError(
                400,
                "the model has no chat template (its files carry none): start the server with"
                " --chat-template FILE|TEMPLATE, or send a text prompt to /v1/completions",
                param="messages",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        limits = [v for v in (req.max_completion_tokens, req.max_tokens) if v is not None]
        params = req.sampling_params(limits[0] if limits else model.context_length)
        if req.logprobs:
            params.update(return_logprob=True, top_logprobs_num=req.top_logprobs or 0)
        add_constraint(params, constraint_params(req.response_format), "response_format")
        tools = ChatTools.of(req, model.tool_parser)
        if tools.constraint is not None:
            add_constraint(params, tools.constraint.params(), "tools")
        messages, template_tools = tools.messages(
            [message_dict(m) for m in req.messages], model.tool_parser, model.template
        )
        rendering = ChatRendering.of(req, model.tokenizer)
        try:
            job = chat_job(
                model.tokenizer, messages, template_tools, rendering, self.limits.max_prompt_bytes
            ).to_json()
        except (ValueError, TypeError) as e:  # no template for these tools, values not JSON
            raise APIError(
                400,
                f"cannot render the messages with the chat template: {e}",
                param="messages",
                code=ErrorCode.INVALID_REQUEST.value,
            ) from e
        shape = ResponseShape(
            chat=True,
            tokenizer=model.tokenizer,
            logprobs=req.logprobs,
            tool_parser=tools.reply_parser,
            reasoning=self.reasoning,
        )
        return ChatInput(job, params, shape)

    async def health(self) -> dict[str, str]:
        """200 once the runtime answers and this gateway has what it needs to serve."""
        try:
            await asyncio.wait_for(asyncio.shield(self.model()), HEALTH_TIMEOUT_S)
            await asyncio.to_thread(self.endpoint.health, HEALTH_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError, *RUNTIME_EXCEPTIONS) as e:
            raise APIError(503, f"the runtime does not answer: {e}", "server_error") from e
        return {"status": "ok"}

    async def render_metrics(self) -> Response:
        """This gateway's request counts and what it holds (requests awaiting the runtime, pin
        leases), then the runtime's (or the router's) own text: what ZeroMQ and DSL clients
        did is in it too."""
        model = await self.model()
        runtime_text = await asyncio.to_thread(self.endpoint.metrics)
        gauges = GatewayGauges(self.endpoint.client.in_flight, len(self.pins.leases))
        return Response(
            self.metrics.render(model.name, runtime_text, gauges), media_type=CONTENT_TYPE_LATEST
        )

    async def unpin_lease(self, lease: PinLease) -> None:
        """Unpin a pin whose lease ended, with its caller's key."""
        key = {"api_key": lease.api_key} if lease.api_key else {}
        await asyncio.to_thread(
            self.endpoint.client.call, "unpin", HEALTH_TIMEOUT_S, pin_id=lease.runtime_id, **key
        )

    async def models(self, request: Request) -> dict[str, Any]:
        """The served model, then each loaded LoRA adapter (its `parent` the model; its `root`
        its path, vLLM's listing, shown to the admin only: a tenant learns no server paths)."""
        model = await self.model()
        adapters = ListLoraAdapters.seen_by(
            await asyncio.to_thread(self.endpoint.list_lora_adapters),
            self.authorized_admin(dict(request.headers.raw)),
        )
        card = {
            "object": "model",
            "created": self.started,
            "owned_by": "radixrt",
            "max_model_len": model.context_length,
        }
        return {
            "object": "list",
            "data": [{"id": model.name, **card}]
            + [
                {"id": a["name"], **card, "parent": model.name}
                | ({"root": a["path"]} if "path" in a else {})
                for a in adapters
            ],
        }


def prompt_bytes(prompt: Prompt) -> int:
    """A prompt's size as `--max-prompt-bytes` counts it: a text's UTF-8 bytes, 4 an id."""
    return len(prompt.encode()) if isinstance(prompt, str) else 4 * len(prompt)


def bearer(headers: dict[bytes, bytes]) -> str:
    """The client's API key: `Authorization: Bearer <key>` (OpenAI's), else `x-api-key: <key>`
    (Anthropic's: its SDK and Claude Code send that)."""
    if b"authorization" in headers:
        return headers[b"authorization"].removeprefix(b"Bearer ").strip().decode("latin-1")
    return headers.get(b"x-api-key", b"").strip().decode("latin-1")
