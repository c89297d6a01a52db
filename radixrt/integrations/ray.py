"""radixrt on Ray Serve LLM: a server class, a prefix-affinity request router and a queue-depth
autoscaling policy.

- `RadixrtServer` is what `LLMConfig(server_cls=RadixrtServer, engine_kwargs={...})` takes: each
  replica starts an `rt.Engine` (its settings are `engine_kwargs`, any `rt.Engine` keyword; an
  unknown one fails the replica's start by name) and answers through radixrt's own HTTP gateway
  code (`Gateway`, `NativeAPI`), so `build_openai_app`'s chat, completions, tokenize and
  detokenize behave as `radixrt serve`'s routes do, errors and stable codes included. The
  control hooks map onto the runtime's ops: `reset_prefix_cache` is `flush_cache`, `pause` and
  `resume` are `pause_generation` and `continue_generation`, `sleep` and `wakeup` are
  `release_memory_occupation` and `resume_memory_occupation` (the KV pool only: radixrt keeps
  its weights, so a sleep that names `weights` or `cuda_graph` is refused by name).
- `RadixAffinityRouter` routes each request to the replica whose cache holds the longest prefix
  of its prompt, unless load is out of balance: radixrt's own cache-aware rule
  (`CacheAwarePolicy`) over radixrt's approximate trees (`ApproxPrefixTree`), one per replica.
- `QueueDepthPolicy` scales on the replicas' `num_requests_waiting`, which each replica reports
  through `record_autoscaling_stats`.
- `RadixrtIngress` is Ray's `OpenAiIngress` whose routes work under FastAPI >= 0.16x (see its
  docstring); `build_openai_app` here is Ray's with it.

`ray.serve.llm` needs vLLM's or SGLang's OpenAI protocol models; on a CPU-only install without
vLLM, `sglang` installed without its dependencies provides them (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.llm._internal.serve.core.configs.llm_config import ModelLoadingConfig
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    EmbeddingResponse,
    ErrorInfo,
    ErrorResponse,
    TokenizeResponse,
)
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter
from ray.serve.config import AutoscalingContext
from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig
from ray.serve.llm import build_openai_app as ray_build_openai_app

from radixrt.client.launcher import Engine
from radixrt.config import RouterSettings, ServerArgs
from radixrt.server.http.app import validation_error
from radixrt.server.http.errors import APIError
from radixrt.server.http.gateway import HEALTH_TIMEOUT_S, Gateway, bearer
from radixrt.server.http.openai_chat import ChatAPI
from radixrt.server.http.openai_embeddings import EmbeddingRequest, embed
from radixrt.server.http.schemas import ChatCompletionRequest, CompletionRequest
from radixrt.server.http.sglang_native import DetokenizeRequest, NativeAPI, TokenizeRequest
from radixrt.server.router.policy import CacheAwarePolicy
from radixrt.server.router.prefix_tree import ApproxPrefixTree, Namespace, Prompt
from radixrt.server.router.worker import DEFAULT_CAPACITY
from radixrt.server.tenants import KeyRing

# the metric names `record_autoscaling_stats` reports (vLLM's and radixrt's /metrics names)
WAITING = "num_requests_waiting"
RUNNING = "num_requests_running"
# what `record_routing_stats` reports: the tokens the replica's cache holds at most
CACHE_CAPACITY = "cache_capacity_tokens"
# The router matches prompts as characters (it has no tokenizer); a token of English text is
# about 4 characters, so a replica's tree holds 4 characters per token of its cache.
CHARS_PER_TOKEN = 4
SLEEP_TAGS = ("kv_cache",)  # what `sleep` may release: radixrt keeps weights and has no graphs


class RadixrtServer:
    """One Ray Serve LLM replica: an `rt.Engine` behind radixrt's gateway code.

    `llm_config.engine_kwargs` are `rt.Engine` keywords; `model` defaults to the config's
    `model_source` and `served_model_name` to its `model_id` (the name clients send). Its keys
    (`api_key_file`, `admin_api_key`, `api_key`, or their environment variables) guard the
    replica as they guard `radixrt serve`: a request without a listed key gets 401
    `invalid_api_key`, and one with a tenant's key runs as that tenant.
    """

    # Ray Serve awaits a replica's async __init__; typing knows no coroutine constructor
    async def __init__(self, llm_config: LLMConfig):  # type: ignore[misc]
        self._llm_config = llm_config
        kwargs = dict(llm_config.engine_kwargs)
        loading = llm_config.model_loading_config
        assert isinstance(loading, ModelLoadingConfig), "LLMConfig's validator made the map one"
        model = kwargs.pop("model", loading.model_source)
        kwargs.setdefault("served_model_name", llm_config.model_id)
        # the runtime loads in its own process; this replica's event loop stays free meanwhile
        self.engine = await asyncio.to_thread(Engine, model, **kwargs)
        self.gateway = Gateway(self.engine, _keys(self.engine.args))
        self.native = NativeAPI(self.gateway)
        self.chat_api = ChatAPI(self.gateway)
        self._paused = False
        self._sleeping = False
        await self.gateway.model()  # the tokenizer, before the first request

    @classmethod
    def get_deployment_options(cls, llm_config: LLMConfig) -> dict[str, Any]:
        """The config's `deployment_config` as it is: a replica is one process plus the runtime
        it starts, placed by `ray_actor_options` (`num_cpus`, and `num_gpus` for a GPU
        runtime)."""
        return copy.deepcopy(llm_config.deployment_config)

    async def start(self) -> None:
        """The engine started in `__init__` (Serve awaits it); kept for the protocol."""

    async def llm_config(self) -> LLMConfig:
        return self._llm_config

    async def chat(
        self, request: Any, raw_request_info: RawRequestInfo | None = None
    ) -> AsyncIterator[Any]:
        async for reply in self._openai(
            request, raw_request_info, ChatCompletionRequest, ChatCompletionResponse
        ):
            yield reply

    async def completions(
        self, request: Any, raw_request_info: RawRequestInfo | None = None
    ) -> AsyncIterator[Any]:
        async for reply in self._openai(
            request, raw_request_info, CompletionRequest, CompletionResponse
        ):
            yield reply

    async def embeddings(
        self, request: Any, raw_request_info: RawRequestInfo | None = None
    ) -> AsyncIterator[EmbeddingResponse | ErrorResponse]:
        """`/v1/embeddings` of a replica started with `is_embedding=True` (refused by name
        by one that generates)."""
        try:
            req = _ours(EmbeddingRequest, request)
            body = await embed(self.gateway, self._request(raw_request_info), req)
            yield EmbeddingResponse.model_validate(body)
        except APIError as e:
            yield _error(e)

    async def tokenize(
        self, request: Any, raw_request_info: RawRequestInfo | None = None
    ) -> AsyncIterator[TokenizeResponse | ErrorResponse]:
        try:
            self._request(raw_request_info)
            req = _ours(TokenizeRequest, request, keep={"prompt", "add_special_tokens"})
            yield TokenizeResponse(**await self.native.tokenize(req))
        except APIError as e:
            yield _error(e)

    async def detokenize(
        self, request: Any, raw_request_info: RawRequestInfo | None = None
    ) -> AsyncIterator[DetokenizeResponse | ErrorResponse]:
        try:
            self._request(raw_request_info)
            req = _ours(DetokenizeRequest, request, keep={"tokens"})
            yield DetokenizeResponse(**await self.native.detokenize(req))
        except APIError as e:
            yield _error(e)

    async def _openai(
        self,
        request: Any,
        raw_request_info: RawRequestInfo | None,
        ours: type[BaseModel],
        reply: type[BaseModel],
    ) -> AsyncIterator[Any]:
        """The request through radixrt's gateway: a stream's events as its SSE text, else the
        body as Ray's response model; an error as Ray's `ErrorResponse` with radixrt's code."""
        try:
            req = _ours(ours, request)
            api = self.chat_api
            method = api.chat if ours is ChatCompletionRequest else api.complete
            response = await method(self._request(raw_request_info), req)
        except APIError as e:
            yield _error(e)
            return
        if isinstance(response, StreamingResponse):
            async for event in response.body_iterator:
                yield event
        elif response.status_code != 200:
            yield _error_from_body(response)
        else:
            yield reply.model_validate(json.loads(bytes(response.body)))

    def _request(self, info: RawRequestInfo | None) -> Request:
        """The client's request for the gateway's handlers, its key checked first as `radixrt
        serve`'s gateway checks it: APIError 401 `invalid_api_key` for a missing or wrong one
        where keys are set (the runtime then names its tenant from it)."""
        request = _starlette_request(info)
        if not self.gateway.authorized(dict(request.headers.raw)):
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer ..., or x-api-key: ...)",
                "authentication_error",
                code="invalid_api_key",
            )
        return request

    async def check_health(self) -> None:
        """Raises (so Serve restarts the replica) when the runtime does not answer."""
        await asyncio.to_thread(self.engine.health, HEALTH_TIMEOUT_S)

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (the runtime's `flush_cache`: refused while requests run)."""
        if not await asyncio.to_thread(self.engine.flush_cache):
            raise RuntimeError("flush_cache refused: requests are in flight")

    async def pause(self, mode: str = "abort") -> None:
        """`pause_generation`: `abort` ends what is in flight, `in_place` keeps it with its KV."""
        await asyncio.to_thread(self.engine.pause_generation, mode)
        self._paused = True

    async def resume(self) -> None:
        await asyncio.to_thread(self.engine.continue_generation)
        self._paused = False

    async def is_paused(self) -> bool:
        return self._paused

    async def sleep(self, tags: list[str] | None = None) -> None:
        """Free the KV pool (`release_memory_occupation`; nothing may be in flight). radixrt
        keeps its weights loaded, so a tag other than `kv_cache` is refused by name."""
        _check_tags(tags)
        await asyncio.to_thread(self.engine.release_memory_occupation)
        self._sleeping = True

    async def wakeup(self, tags: list[str] | None = None) -> None:
        _check_tags(tags)
        await asyncio.to_thread(self.engine.resume_memory_occupation)
        self._sleeping = False

    async def is_sleeping(self) -> bool:
        return self._sleeping

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The runtime's queue, for `QueueDepthPolicy`."""
        stats = await asyncio.to_thread(self.engine.stats)
        return {WAITING: stats["waiting"], RUNNING: stats["running"]}

    async def record_routing_stats(self) -> dict[str, Any]:
        """The cache's size in tokens (pool plus host tier), which bounds the router's tree."""
        stats = await asyncio.to_thread(self.engine.stats)
        return {CACHE_CAPACITY: stats["total_tokens"] + stats["host_total_tokens"]}

    def __del__(self) -> None:
        """Serve's replica shutdown: the runtime process stops with it."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _keys(args: ServerArgs) -> KeyRing:
    """The keys the replica's runtime takes, as `radixrt serve` reads them (its settings, else
    their environment variables), so its gateway admits and names callers the same way."""
    args = args.with_secrets_from_env()
    return KeyRing.from_settings(args.api_key, args.api_key_file, args.admin_api_key)


def _check_tags(tags: list[str] | None) -> None:
    refused = sorted(set(tags or ()) - set(SLEEP_TAGS))
    if refused:
        raise ValueError(
            f"sleep/wakeup tags {refused}: radixrt releases only its KV pool ({list(SLEEP_TAGS)})"
        )


def _ours(model: type[BaseModel], request: Any, keep: set[str] | None = None) -> Any:
    """Ray's request (a pydantic model) as radixrt's body: the fields the client set, so one
    radixrt does not know is refused by name (400 `invalid_request`), as its gateway does.
    `keep`: the only fields to carry (for bodies whose other fields radixrt has no use for)."""
    given = request.model_dump(exclude_unset=True)
    if keep is not None:
        given = {k: v for k, v in given.items() if k in keep}
    try:
        return model.model_validate(given)
    except ValidationError as e:
        raise _refusal(e) from e


def _refusal(e: ValidationError) -> APIError:
    """A body that does not validate, as radixrt's gateway answers it (400 naming each field)."""
    return validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()])


def _starlette_request(info: RawRequestInfo | None) -> Request:
    """A request for the gateway's handlers: the client's headers (its API key) and a client
    that never disconnects, since Serve cancels this replica's call when the client leaves."""
    headers = info.headers if info is not None else {}
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "query_string": b"",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
    }

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return Request(scope, receive)


def _error(e: APIError) -> ErrorResponse:
    """radixrt's error as Ray's: the HTTP status is its `code`, radixrt's stable code its
    `type` (its kind when it has none)."""
    info = ErrorInfo(message=str(e), type=e.code or e.kind, param=e.param, code=e.status)
    return ErrorResponse(error=info)


def _error_from_body(response: Response) -> ErrorResponse:
    error = json.loads(bytes(response.body))["error"]
    return _error(
        APIError(
            response.status_code,
            error["message"],
            error.get("type", "server_error"),
            error.get("param"),
            error.get("code"),
        )
    )


# --- ingress -------------------------------------------------------------------------------


class RadixrtIngress(OpenAiIngress):
    """Ray's OpenAI ingress, with routes that find their replica in any process.

    Ray turns the ingress's methods into FastAPI routes by giving each one's `self` a default,
    `Depends(<the replica's object>)`, as an attribute of the function, in the process that
    builds the app. The function reaches the replica by reference (its module is importable),
    without that attribute, and FastAPI >= 0.16x reads the route's signature there, lazily: the
    route then asks for `self` as a query parameter and answers 400 (Ray 2.60 with FastAPI
    0.165). Here each route is this module's own function whose signature says so from
    import on, in every process. Chat and completion bodies are also checked against radixrt's
    own models first (`CHECKED_BODIES`), so a field radixrt does not know is refused by name
    (400 `invalid_request`) instead of dropped by Ray's body models.
    """


def _replica_object() -> Any:
    return serve.get_replica_context().servable_object


# the routes whose body radixrt reads, by the model that must accept it first: Ray's body models
# ignore a field they do not know, radixrt refuses it by name
CHECKED_BODIES: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
}


def _route(name: str) -> Any:
    """`OpenAiIngress.<name>` as a route whose `self` is the replica's object; a body that
    radixrt's own model for the route refuses is answered 400 before Ray parses it."""
    original, checked = getattr(OpenAiIngress, name), CHECKED_BODIES.get(name)

    async def route(self: Any, *args: Any, **kwargs: Any) -> Any:
        if checked is not None:
            try:
                checked.model_validate(await kwargs["request"].json())
            except ValidationError as e:
                return _refusal(e).response()
        return await original(self, *args, **kwargs)

    signature = inspect.signature(original)
    first, *rest = signature.parameters.values()
    route.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            first.replace(default=Depends(_replica_object)),
            *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in rest),
        ]
    )
    route.__name__, route.__qualname__ = name, f"RadixrtIngress.{name}"
    route.__doc__ = original.__doc__
    return route


for _name in DEFAULT_ENDPOINTS:
    setattr(RadixrtIngress, _name, _route(_name))


def build_openai_app(builder_config: dict[str, Any]) -> Application:
    """Ray's `build_openai_app` (the same `LLMServingArgs`), with `RadixrtIngress` as the
    ingress unless `ingress_cls_config` names another."""
    return ray_build_openai_app(
        {"ingress_cls_config": {"ingress_cls": RadixrtIngress}} | builder_config
    )


# --- routing -------------------------------------------------------------------------------


@dataclass
class _ReplicaView:
    """A candidate replica as `CacheAwarePolicy` sees a worker."""

    index: int
    load: int
    tree: ApproxPrefixTree
    replica: RunningReplica


def routing_prompt(pending_request: PendingRequest | None) -> Prompt | None:
    """The request's prompt as the router matches it: the chat messages (role and text, in
    order) or the completion prompt, as characters, under its namespace (the caller's key,
    hashed, and its `cache_salt`): a prefix of the conversation is a prefix of this. None when
    the request carries neither."""
    if pending_request is None or not pending_request.args:
        return None
    body = pending_request.args[0]
    messages, prompt = getattr(body, "messages", None), getattr(body, "prompt", None)
    if messages is not None:
        text = "".join(_message_text(m) for m in messages)
    elif isinstance(prompt, str):
        text = prompt
    else:
        return None
    info = pending_request.args[1] if len(pending_request.args) > 1 else None
    return Prompt(_namespace(body, info), [ord(c) for c in text])


def _message_text(message: Any) -> str:
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return f"{message.get('role')}\x00{content or ''}\x00"


def _namespace(body: Any, info: RawRequestInfo | None) -> Namespace:
    raw = {k.lower().encode(): v.encode() for k, v in (info.headers if info else {}).items()}
    key = bearer(raw) if raw else ""
    tenant = hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""
    return Namespace(tenant=tenant, cache_salt=getattr(body, "cache_salt", None) or "")


class RadixAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: radixrt's cache-aware rule over one approximate prefix tree per
    replica (what this router sent there, bounded by the replica's cache as its
    `record_routing_stats` reports it, least recently used forgotten first). Load is the
    requests this router has in flight on each replica. Set it on the server deployment:
    `deployment_config={"request_router_config": {"request_router_class":
    "radixrt.integrations.ray:RadixAffinityRouter"}}`; `request_router_kwargs` take
    `router_cache_threshold`, `router_balance_abs_threshold`, `router_balance_rel_threshold`
    (`radixrt router`'s settings and defaults)."""

    def initialize_state(self, **settings: Any) -> None:
        self._policy = CacheAwarePolicy(RouterSettings(**settings))
        self._trees: dict[ReplicaID, ApproxPrefixTree] = {}
        self._in_flight: Counter[ReplicaID] = Counter()
        self._requests: dict[str, ReplicaID] = {}
        self.routes: Counter[str] = Counter()  # by RouteReason, for tests and logs

    def _tree(self, replica: RunningReplica) -> ApproxPrefixTree:
        tree = self._trees.setdefault(replica.replica_id, ApproxPrefixTree(DEFAULT_CAPACITY))
        tokens = (replica.routing_stats or {}).get(CACHE_CAPACITY)
        if tokens:
            tree.capacity = CHARS_PER_TOKEN * int(tokens)
        return tree

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        prompt = routing_prompt(pending_request)
        if prompt is None or not candidate_replicas:
            return [candidate_replicas]  # Serve picks the shortest queue among them
        views = [
            _ReplicaView(i, self._in_flight[r.replica_id], self._tree(r), r)
            for i, r in enumerate(candidate_replicas)
        ]
        route = self._policy.choose(prompt, views)
        self.routes[route.reason.value] += 1
        chosen = route.worker.replica
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        prompt = routing_prompt(pending_request)
        tree = self._trees.get(replica_id)
        if prompt is not None and tree is not None:
            tree.insert(prompt)
        self._in_flight[replica_id] += 1
        self._requests[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._requests.pop(internal_request_id, None) is not None:
            self._in_flight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """A replica gone takes its tree with it: one that comes back starts empty, as its
        cache does."""
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in set(self._trees) - live:
            del self._trees[gone]
            self._in_flight.pop(gone, None)


# --- autoscaling ---------------------------------------------------------------------------


class QueueDepthPolicy:
    """Ray Serve autoscaling on the runtimes' waiting queues: more replicas while more than
    `target_waiting` requests wait per replica (enough that `target_waiting` would), the
    minimum once nothing waits or runs, else as many as now. Ray applies the config's bounds
    and up/downscale delays around it. Set it on the server deployment:
    `"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "policy": {"policy_function":
    "radixrt.integrations.ray:QueueDepthPolicy", "policy_kwargs": {"target_waiting": 2}}}`."""

    def __init__(self, target_waiting: float = 2.0):
        if target_waiting <= 0:
            raise ValueError("target_waiting must be > 0")
        self.target_waiting = target_waiting

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        waiting = sum(metrics.get(WAITING, {}).values())
        running = sum(metrics.get(RUNNING, {}).values())
        current = max(ctx.current_num_replicas, 1)
        if waiting > self.target_waiting * current:
            desired = math.ceil(waiting / self.target_waiting)
        elif waiting == 0 and running == 0:
            desired = ctx.capacity_adjusted_min_replicas
        else:
            desired = ctx.current_num_replicas
        bounded = min(
            max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas
        )
        return bounded, ctx.policy_state


__all__ = [
    "QueueDepthPolicy",
    "RadixAffinityRouter",
    "RadixrtIngress",
    "RadixrtServer",
    "build_openai_app",
    "routing_prompt",
]
