"""OpenAI-compatible HTTP gateway (FastAPI + uvicorn) in front of a runtime.

`radixrt serve --http-port P` binds the HTTP socket and hands it to a child process
(`radixrt http-gateway`): the scheduler must keep its own process's main thread, so the HTTP front
lives next to it and speaks the ZeroMQ protocol through `RuntimeEndpoint`, like any other client.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from radixrt.client import RemoteError
from radixrt.config import SECRETS, ServerArgs
from radixrt.constrained import DTYPE_REGEXES, JSON_WHITESPACE
from radixrt.endpoint import Prompt, RuntimeEndpoint
from radixrt.prometheus_metrics import GatewayMetrics
from radixrt.protocol import ErrorCode

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there
PARENT_POLL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
RUNTIME_EXCEPTIONS = (RemoteError, ValueError, ConnectionError)
# the runtime's error code -> (HTTP status, OpenAI error type); never decided from message text
HTTP_ERRORS = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.INVALID_CONSTRAINT: (400, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.ABORTED: (499, "client_disconnected"),
    ErrorCode.OVERLOADED: (503, "overloaded_error"),
    ErrorCode.DRAINING: (503, "overloaded_error"),
    ErrorCode.CONNECTION_LOST: (503, "server_error"),
    ErrorCode.WORKER_LOST: (503, "server_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.INTERNAL_ERROR: (500, "server_error"),
}


def _json_object_regex() -> str:
    """`response_format: json_object`: a JSON object whose values are scalars, or arrays and
    objects of scalars. The constraint compiler refuses free-form JSON schemas, and one more level
    of nesting takes over its compile budget (10 s), so this grammar stops at depth two."""
    ws, string = JSON_WHITESPACE, DTYPE_REGEXES["str"]
    scalar = f"({string}|{DTYPE_REGEXES['float']}|true|false|null)"

    def array(value: str) -> str:
        return rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"

    def obj(value: str) -> str:
        member = f"{string}{ws}:{ws}{value}"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"

    return obj(f"({scalar}|{array(scalar)}|{obj(scalar)})")


JSON_OBJECT_REGEX = _json_object_regex()


# ---- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _from_runtime(e: Exception) -> APIError:
    """The runtime's error as OpenAI's, by its code; a ValueError raised on this side (before any
    request was sent) is the caller's mistake, any other failure a lost runtime."""
    if isinstance(e, RemoteError):
        status, api_kind = HTTP_ERRORS.get(ErrorCode.parse(e.code), (500, "server_error"))
        return APIError(status, e.message, api_kind, code=e.code)
    if isinstance(e, ValueError):
        return APIError(400, str(e), code=ErrorCode.INVALID_REQUEST.value)
    return APIError(503, str(e), "server_error", code=ErrorCode.CONNECTION_LOST.value)


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerateRequest(BaseModel):
    model: str | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The runtime validates the values (docs/protocol.md); unset ones keep its defaults."""
        given = {k: getattr(self, k) for k in ("n", "stop", "temperature", "top_p", "seed", "frequency_penalty",
                                                "presence_penalty")}
        return {"max_new_tokens": max_new_tokens, **{k: v for k, v in given.items() if v is not None}}


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the template may use them
    role: str
    content: str | list[dict[str, Any]] | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


def render_chat(tokenizer, messages: list[dict[str, Any]]) -> str:
    """Messages -> the prompt text, with the model's own chat template, ready for the assistant."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _message(m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        if any(part.get("type") != "text" for part in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        message["content"] = "".join(str(part.get("text", "")) for part in m.content)
    return message


def _constraint(fmt: ResponseFormat | None) -> dict[str, Any]:
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"regex": JSON_OBJECT_REGEX}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                       param="response_format")
    return {"json_schema": schema}


def _prompts(prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompt


# ---- responses ---------------------------------------------------------------------------------
@dataclass
class _Shape:
    """What differs between chat and text completions."""
    chat: bool
    tokenizer: Any
    logprobs: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def choice(self, index: int, text: str, meta: dict[str, Any], stream: bool = False) -> dict[str, Any]:
        """A finished sample; in a stream its text already went out as deltas."""
        if self.chat:
            body = {"delta": {}} if stream else {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": "" if stream else text}
        return {"index": index, **body, "logprobs": self._logprobs(meta) if self.logprobs else None,
                "finish_reason": meta["finish_reason"]["type"]}

    def delta(self, index: int, text: str, first: bool = False) -> dict[str, Any]:
        if self.chat:
            body = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        else:
            body = {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": None}

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's logprobs of a sample, from the runtime's [logprob, token id] pairs."""
        decode = self.tokenizer.decode
        chosen = [(decode([tid]), lp) for lp, tid in meta["output_token_logprobs"]]
        tops = [[(decode([tid]), lp) for lp, tid in top] for top in meta.get("output_top_logprobs", [])]
        if self.chat:
            def entry(token: str, logprob: float) -> dict[str, Any]:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [{**entry(*c), "top_logprobs": [entry(*t) for t in top]}
                                for c, top in zip(chosen, tops or [[]] * len(chosen))]}
        offsets = list(itertools.accumulate((len(t) for t, _ in chosen), initial=0))[:-1]
        return {"tokens": [t for t, _ in chosen], "token_logprobs": [lp for _, lp in chosen], "text_offset": offsets,
                "top_logprobs": [dict(top) for top in tops] if tops else None}


def _usage(samples: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Usage over prompts (each counted once) and all their samples."""
    firsts = [s[0]["meta_info"] for s in samples]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(s["meta_info"]["completion_tokens"] for per_prompt in samples for s in per_prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}}


def _body(shape: _Shape, rid: str, model: str, choices: list, usage: dict | None = None,
          chunk: bool = False) -> dict[str, Any]:
    body = {"id": rid, "object": shape.chunk_object if chunk else shape.object, "created": int(time.time()),
            "model": model, "choices": choices}
    return body if usage is None else {**body, "usage": usage}


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _unless_disconnected(request: Request, coros: list) -> list:
    """Await the coroutines; cancel them all (which aborts their runtime requests) when one fails
    or the client goes away."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if (error := task.exception()) is not None:
                    raise _from_runtime(error) if isinstance(error, RUNTIME_EXCEPTIONS) else error
            if not pending:
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection", "client_disconnected")
    finally:
        for task in tasks:
            task.cancel()


async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for reply in rest:
        yield reply


# ---- the gateway -------------------------------------------------------------------------------
@dataclass
class _Model:
    name: str
    context_length: int
    tokenizer: Any


class Gateway:
    def __init__(self, endpoint: RuntimeEndpoint, api_key: str | None = None):
        self.endpoint = endpoint
        self.api_key = api_key
        self.metrics = GatewayMetrics()
        self.started = int(time.time())
        self._model: _Model | None = None
        self._model_lock = asyncio.Lock()

    async def model(self) -> _Model:
        # Loaded once, from start-up on (see build_app): the runtime answers once `serve` runs its loop.
        async with self._model_lock:
            if self._model is None:
                self._model = await asyncio.to_thread(self._load_model)
        return self._model

    def _load_model(self) -> _Model:
        from transformers import AutoTokenizer

        info = self.endpoint.model_info
        return _Model(info["model"], info["context_length"], AutoTokenizer.from_pretrained(info["model_path"]))

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        given = headers.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
        return hmac.compare_digest(given, self.api_key.encode())

    async def complete(self, request: Request, req: CompletionRequest) -> Response:
        model = await self.model()
        params = req.sampling_params(req.max_tokens)
        if req.logprobs is not None:
            params.update(return_logprob=True, top_logprobs_num=req.logprobs)
        shape = _Shape(chat=False, tokenizer=model.tokenizer, logprobs=req.logprobs is not None)
        return await self._respond(request, req, model, _prompts(req.prompt), params, shape)

    async def chat(self, request: Request, req: ChatCompletionRequest) -> Response:
        model = await self.model()
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        limits = [v for v in (req.max_completion_tokens, req.max_tokens) if v is not None]
        params = req.sampling_params(limits[0] if limits else model.context_length)
        if req.logprobs:
            params.update(return_logprob=True, top_logprobs_num=req.top_logprobs or 0)
        params.update(_constraint(req.response_format))
        messages = [_message(m) for m in req.messages]
        try:
            prompt = render_chat(model.tokenizer, messages)
        except (TemplateError, ValueError) as e:  # the template's own checks (roles must alternate, ...)
            raise APIError(400, f"cannot render the messages with the chat template: {e}", param="messages") from e
        shape = _Shape(chat=True, tokenizer=model.tokenizer, logprobs=req.logprobs)
        return await self._respond(request, req, model, [prompt], params, shape)

    async def _respond(self, request: Request, req: _GenerateRequest, model: _Model, prompts: list[Prompt],
                       params: dict[str, Any], shape: _Shape) -> Response:
        rid = f"{shape.id_prefix}{uuid.uuid4().hex}"
        if req.stream:
            if len(prompts) != 1:
                raise APIError(400, "stream: true takes one prompt", param="prompt")
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._stream(request, rid, model, prompts[0], params, shape, include_usage)
        samples = await _unless_disconnected(request, [self._generate(p, params) for p in prompts])
        choices = [shape.choice(i * len(per_prompt) + j, s["text"], s["meta_info"])
                   for i, per_prompt in enumerate(samples) for j, s in enumerate(per_prompt)]
        return JSONResponse(_body(shape, rid, model.name, choices, _usage(samples)))

    async def _generate(self, prompt: Prompt, params: dict[str, Any]) -> list[dict[str, Any]]:
        out = await self.endpoint.async_generate(prompt, params)
        samples = out if isinstance(out, list) else [out]
        for j, s in enumerate(samples):
            self.metrics.observe(s["meta_info"], count_prompt=j == 0)
        return samples

    async def _stream(self, request: Request, rid: str, model: _Model, prompt: Prompt, params: dict[str, Any],
                      shape: _Shape, include_usage: bool) -> StreamingResponse:
        replies = self.endpoint.async_stream(prompt, params)
        # Wait for the first reply before sending headers, so a rejected request gets its 4xx.
        first, = await _unless_disconnected(request, [replies.__anext__()])
        events = self._events(rid, model.name, _prepend(first, replies), shape, params.get("n", 1), include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, rid: str, model: str, replies: AsyncIterator[dict], shape: _Shape, n: int,
                      include_usage: bool) -> AsyncIterator[str]:
        # A client that disconnects cancels this generator inside `replies`, which aborts the request.
        if shape.chat:
            yield _event(_body(shape, rid, model, [shape.delta(i, "", first=True) for i in range(n)], chunk=True))
        finals = []
        try:
            async for reply in replies:
                index = reply.get("index", 0)
                if reply["finished"]:
                    finals.append(reply)
                    self.metrics.observe(reply["meta_info"], count_prompt=index == 0)
                    yield _event(_body(shape, rid, model, [shape.choice(index, "", reply["meta_info"], stream=True)],
                                       chunk=True))
                elif reply["delta"]:
                    yield _event(_body(shape, rid, model, [shape.delta(index, reply["delta"])], chunk=True))
        except RUNTIME_EXCEPTIONS as e:
            yield _event(_from_runtime(e).body())
            return
        if include_usage:
            finals.sort(key=lambda r: r.get("index", 0))
            yield _event(_body(shape, rid, model, [], usage=_usage([finals]), chunk=True))
        yield "data: [DONE]\n\n"

    async def health(self) -> dict:
        """200 once the runtime answers and this gateway has what it needs to serve."""
        try:
            await asyncio.wait_for(asyncio.shield(self.model()), HEALTH_TIMEOUT_S)
            await asyncio.to_thread(self.endpoint.health, HEALTH_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError, *RUNTIME_EXCEPTIONS) as e:
            raise APIError(503, f"the runtime does not answer: {e}", "server_error") from e
        return {"status": "ok"}

    async def render_metrics(self) -> Response:
        stats = await asyncio.to_thread(self.endpoint.stats)
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        model = await self.model()
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": self.started,
                                            "owned_by": "radixrt", "max_model_len": model.context_length}]}


class _Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would get between streams and disconnects):
    Bearer key on /v1/*, request counts by route and status."""

    def __init__(self, app, gateway: Gateway):
        self.app, self.gateway = app, gateway

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = 500

        async def send_observed(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if path.startswith("/v1/") and not self.gateway.authorized(dict(scope["headers"])):
                error = APIError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send_observed)
            await self.app(scope, receive, send_observed)
        finally:
            self.gateway.metrics.requests.labels(path if path in ROUTES else "other", str(status)).inc()


def build_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        warm_up = asyncio.create_task(gateway.model())  # the tokenizer loads while the runtime starts
        yield
        warm_up.cancel()

    app = FastAPI(title="radixrt", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(map(str, err.get('loc', ())[1:])) or 'body'}: {err.get('msg')}"
                            for err in e.errors())
        return APIError(400, message or "bad request", param=param).response()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await gateway.complete(request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await gateway.chat(request, req)

    app.get("/v1/models")(gateway.models)
    app.get("/health")(gateway.health)
    app.get("/metrics")(gateway.render_metrics)
    app.add_middleware(_Guard, gateway=gateway)
    return app


# ---- processes ---------------------------------------------------------------------------------
def start_gateway(args: ServerArgs) -> subprocess.Popen:
    """Bind the HTTP port here (a busy port fails `serve` at once) and hand it to a gateway child."""
    host = args.http_host
    if not args.is_loopback and not args.api_key:
        raise SystemExit(f"refusing to serve HTTP on {host} without --api-key")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, args.http_port), family=family, backlog=1024)
    command = [sys.executable, "-m", "radixrt", "http-gateway", "--url", args.endpoint, "--fd", str(sock.fileno()),
               "--parent-pid", str(os.getpid()), "--log-level", args.log_level]
    if args.curve_secret_key:
        command += ["--curve-server-key", zmq.curve_public(args.curve_secret_key.encode()).decode()]
    env = dict(os.environ)
    if args.api_key:
        env[SECRETS["api_key"]] = args.api_key
    with sock:
        proc = subprocess.Popen(command, pass_fds=[sock.fileno()], env=env)
    logger.info("OpenAI-compatible HTTP gateway on http://%s:%d/v1", host, args.http_port)
    return proc


def stop_gateway(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_gateway(url: str, fd: int, parent_pid: int | None = None, api_key: str | None = None,
                curve_server_key: str | None = None, log_level: str = "info") -> None:
    """Serve HTTP on the inherited listening socket `fd` until SIGTERM/SIGINT or the parent exits."""
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    endpoint = RuntimeEndpoint(url, api_key=api_key, curve_server_key=curve_server_key)
    config = uvicorn.Config(build_app(Gateway(endpoint, api_key)), log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def watch_parent() -> None:
        while not server.should_exit:
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("the runtime process is gone; stopping the HTTP gateway")
                server.should_exit = True
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        server.run(sockets=[socket.socket(fileno=fd)])
    finally:
        endpoint.close()
