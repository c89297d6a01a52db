"""The gateway's FastAPI app: every API's routes over one `Gateway`, one module each (OpenAI's
chat and completions, Responses and embeddings, Anthropic's Messages, SGLang's native routes and
the control ops' routes), `/v1/models`, `/health` and `/metrics` here; the API-key and site guard,
the error handlers and the request metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixrt.protocol import ErrorCode
from radixrt.server.http.anthropic_messages import (
    MESSAGES_ROUTES,
    add_messages_routes,
    error_response,
)
from radixrt.server.http.cpu_pool import CALLER, Caller
from radixrt.server.http.errors import APIError
from radixrt.server.http.gateway import OPENAI_ROUTES, Gateway, bearer
from radixrt.server.http.openai_chat import add_chat_routes
from radixrt.server.http.openai_embeddings import add_embedding_routes
from radixrt.server.http.openai_responses import RESPONSES_ROUTES, add_responses_routes
from radixrt.server.http.origins import SitePolicy
from radixrt.server.http.sglang_native import KEYED_ROUTES, add_native_routes
from radixrt.server.tenants import Principal

# a body whose client sends nothing for this long is answered 408 (a slow client holds a
# connection, never a thread; this bounds how long)
BODY_IDLE_S = 30.0


class _Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would get between streams and disconnects):
    Bearer key on /v1/* and the native routes, the admin's on /metrics; without keys, no
    request from another site (`SitePolicy`); a POST's body JSON (`Content-Type`: a page's form
    cannot send that without a preflight) of at most the runtime's frame limit (413, judged by
    Content-Length and then by what arrives), arriving within BODY_IDLE_S between its parts
    (408); request counts by route and status. Sets `CALLER` (tenant and body size) for the
    route's CPU-pool jobs."""

    def __init__(self, app: ASGIApp, gateway: Gateway, keyed_routes: tuple[str, ...] = ()):
        self.app, self.gateway = app, gateway
        self.keyed_routes = keyed_routes  # beside /v1/*: need an accepted key
        limits = gateway.limits
        self.site = SitePolicy.of(limits.host, limits.allowed_hosts, limits.allowed_origins)
        # labelled by name in the metrics
        self.routes = {*OPENAI_ROUTES, *MESSAGES_ROUTES, *RESPONSES_ROUTES, *keyed_routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            headers = dict(scope["headers"])
            # the key is resolved once (each resolution compares every key in constant time)
            principal = self.gateway.keys.principal_of(bearer(headers))
            error = self._refusal(path, scope["method"], headers, principal)
            if error is None:
                error, body = await _read_body(scope, receive, self.gateway.limits.max_frame_bytes)
            if error is not None:
                return await error_response(path, error)(scope, receive, send_observed)
            CALLER.set(Caller(principal.tenant if principal else "", len(body)))
            await self.app(scope, _replay(body, receive), send_observed)
        finally:
            self.gateway.metrics.count(path if path in self.routes else "other", status)

    def _refusal(
        self, path: str, method: str, headers: dict[bytes, bytes], principal: Principal | None
    ) -> APIError | None:
        if not self.gateway.keys.keys and (why := self.site.refusal(headers)):
            return APIError(403, why, "permission_error", code="forbidden")
        if method == "POST" and not _is_json(headers.get(b"content-type", b"")):
            return APIError(
                415,
                "a POST's body is JSON: send Content-Type: application/json",
                code=ErrorCode.INVALID_REQUEST.value,
            )
        keyed = path.startswith("/v1/") or path in self.keyed_routes
        if keyed and principal is None:
            needed = "API key"
        elif path == "/metrics" and not (principal and principal.admin):
            needed = "admin API key (--admin-api-key)"
        else:
            return None
        return APIError(
            401,
            f"missing or wrong {needed} (Authorization: Bearer ..., or x-api-key: ...)",
            "authentication_error",
            code="invalid_api_key",
        )


def _is_json(content_type: bytes) -> bool:
    """`application/json` (with parameters: `; charset=utf-8`) or a `+json` type."""
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or kind.endswith(b"+json")


async def _read_body(scope: Scope, receive: Receive, limit: int) -> tuple[APIError | None, bytes]:
    """The whole request body; a 413 when it is past `limit` bytes (at once by its declared
    Content-Length, else, a chunked body declaring none, once it has arrived, holding no more
    than `limit` bytes meanwhile), a 408 when the client sends none of it for BODY_IDLE_S."""
    too_large = APIError(413, f"the request body is over {limit} bytes")
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return too_large, b""
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), BODY_IDLE_S)
        except (TimeoutError, asyncio.TimeoutError):
            return APIError(408, f"no part of the body came for {BODY_IDLE_S:g} s"), b""
        if message["type"] != "http.request":
            return None, b"".join(chunks)  # the client left; the app sees an empty body
        size += len(message.get("body", b""))
        if size > limit:
            chunks.clear()  # the rest is read and dropped, so the client hears the 413
        else:
            chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return (too_large, b"") if size > limit else (None, b"".join(chunks))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body read already, then the client's own messages
    (a disconnect, which streaming responses watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A body that does not validate, as one 400 naming each bad field: a field this server
    does not know is said so by name (pydantic's `extra_forbidden`), never dropped."""

    def where(err: dict[str, Any]) -> str:
        return ".".join(map(str, err.get("loc", ())[1:])) or "body"

    def what(err: dict[str, Any]) -> str:
        if err.get("type") == "extra_forbidden":
            return f"unknown field {where(err)!r}: this server does not support it"
        return f"{where(err)}: {err.get('msg')}"

    param = where(errors[0]) if errors else None
    message = "; ".join(what(err) for err in errors) or "bad request"
    return APIError(400, message, param=param, code=ErrorCode.INVALID_REQUEST.value)


def build_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the tokenizer loads while the runtime starts
        warm_up = asyncio.create_task(gateway.model())
        expiry = asyncio.create_task(gateway.pins.expire_forever(gateway.unpin_lease))
        yield
        warm_up.cancel()
        expiry.cancel()
        gateway.cpu.close()
        gateway.templates.close()
        # a call still waiting for the runtime (one that never started) ends, so its worker
        # thread does too and the process can exit
        gateway.endpoint.client.fail_pending("the HTTP gateway is stopping")

    app = FastAPI(title="radixrt", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(request.url.path, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Starlette's own refusals (an unknown route, a method it does not take, a body that
        does not parse) in the API's error shape, as every other error."""
        code = ErrorCode.INVALID_REQUEST.value if e.status_code < 500 else None
        return error_response(request.url.path, APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, validation_error(list(e.errors())))

    app.get("/v1/models")(gateway.models)
    app.get("/health")(gateway.health)
    app.get("/metrics")(gateway.render_metrics)
    add_chat_routes(app, gateway)
    add_native_routes(app, gateway)
    add_messages_routes(app, gateway)
    add_responses_routes(app, gateway)
    add_embedding_routes(app, gateway)
    app.add_middleware(_Guard, gateway=gateway, keyed_routes=KEYED_ROUTES)
    return app
