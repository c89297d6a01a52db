"""The runtime process: a ZeroMQ ROUTER socket in front of the scheduler loop.

The loop never blocks on the socket: it drains what has arrived, runs one step, and sends what
the step produced. Every frame is one msgpack map; see docs/protocol.md.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import zmq

from radixrt.config import ServerArgs
from radixrt.engine.request import Req, RequestScope
from radixrt.engine.scheduler import Scheduler
from radixrt.protocol import (
    GENERATE_FIELDS,
    MAX_PIN_ID_CHARS,
    CheckInvariants,
    ControlOp,
    ErrorCode,
    FlushCache,
    Health,
    ListLoraAdapters,
    LoadLoraAdapter,
    MemorySnapshot,
    Metrics,
    ModelInfo,
    Ping,
    RequestError,
    Shutdown,
    Stats,
    UnloadLoraAdapter,
    Unpin,
    check_rid,
    error_reply,
    internal_error_text,
)
from radixrt.sampling_params import SamplingParams
from radixrt.server import rollout
from radixrt.server.front import (
    Caller,
    ClientFront,
    FrontConfig,
    Op,
    visible_stats,
)
from radixrt.server.heap import Heap
from radixrt.server.metrics import RuntimeMetrics
from radixrt.server.prompts import PromptTokenizer
from radixrt.server.tenants import Principal

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
STALLED_POLL_MS = 5  # work is waiting on something else (a constraint compiling): do not spin


@dataclass(eq=False)
class ClientRequest:
    """Whom a runtime request answers: the client's socket identity, its own rid, whether it
    streams, which of its n samples this is, and how much of a stream has gone out."""

    identity: bytes
    rid: str
    stream: bool
    index: int
    limit_key: str = ""  # whose per-tenant limits it counts against (see `_limit_key`)
    text_sent: int = 0  # characters of the text already streamed
    ids_sent: int = 0  # output token ids already streamed
    tokens_seen: int = 0  # output tokens when its last step published (for the ITL histogram)
    last_token_at: float | None = None  # when that step published


@dataclass(frozen=True)
class TenantCaps:
    """The per-tenant limits in force (None: none): `--max-inflight-per-tenant` and
    `--max-queued-tokens-per-tenant`, which with `--api-key-file` default to a quarter of the
    queue and four times the KV pool, so no tenant can fill the queue alone."""

    requests: int | None
    queued_tokens: int | None

    @classmethod
    def of(cls, args: ServerArgs, pool_tokens: int) -> TenantCaps:
        keyed = bool(args.api_key_file)
        return cls(
            args.max_inflight_per_tenant
            or (max(args.max_queued_requests // 4, 1) if keyed else None),
            args.max_queued_tokens_per_tenant or (4 * pool_tokens if keyed else None),
        )


class Server:
    def __init__(self, args: ServerArgs, endpoint: str):
        self.args = args
        self.scheduler = Scheduler.from_server_args(args)
        self.tokenizer = self.scheduler.tokenizer
        self.prompts = PromptTokenizer(self.tokenizer, args.max_prompt_bytes)
        self.tenant_caps = TenantCaps.of(args, self.scheduler.kv.total_tokens)
        self.ctx = zmq.Context()
        ops = {name: replace(op, run=partial(op.run, self)) for name, op in OPS.items()}
        self.front = ClientFront(self.ctx, endpoint, FrontConfig.of(args), ops)
        self.clients: dict[Req, ClientRequest] = {}
        self.server_id = uuid.uuid4().hex
        self.running = True
        self.drain_deadline: float | None = None  # set by SIGTERM: refuse new work, finish old
        self.heap = Heap()
        self.metrics = RuntimeMetrics(args.model_name)
        self.pending_update: rollout.PendingUpdate | None = None  # waits for requests in flight
        self.joins: list[rollout.Join] = []  # trainers' groups being joined beside the loop

    # ---- the loop ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        while self.running:
            try:
                self._serve_once()
            except Exception:
                # a bug outside a step (a step contains its own): logged, and the loop goes on;
                # with tensor-parallel ranks it ends, since they may be out of step
                if self.scheduler.tp_size > 1:
                    raise
                logger.exception("a turn of the serving loop failed; serving on")
        self.scheduler.close()
        self.prompts.close()
        self.front.close()
        self.ctx.term()

    def _serve_once(self) -> None:
        self._drain(block=not self.scheduler.can_step())
        for tokenized in self.prompts.ready():  # its op runs again, now with the text's ids
            self.front.dispatch(tokenized.caller, tokenized.msg)
        self._abort_vanished_clients()
        if self.scheduler.can_step():
            self.publish(self.scheduler.step())
        else:
            self.scheduler.idle()
        rollout.run_pending_update(self)
        rollout.poll_joins(self)
        if self.drain_deadline is not None:
            self._drain_step()
        self.heap.tick()

    def begin_drain(self) -> None:
        """Stop taking generates (they get `draining`); the loop ends once what is queued and
        running has finished, or after `--drain-timeout` seconds, when the rest is ended."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.args.drain_timeout
            logger.info(
                "draining: %d running, %d waiting; at most %.0f s",
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                self.args.drain_timeout,
            )

    def _drain_step(self) -> None:
        assert self.drain_deadline is not None, "called while draining only"
        if self.scheduler.has_work() and time.monotonic() < self.drain_deadline:
            return
        if self.scheduler.has_work():
            self.publish(
                self.scheduler.end_all(
                    ErrorCode.DRAINING, "the server stopped (drain timeout) before it finished"
                )
            )
        logger.info("drained; stopping")
        self.running = False

    def fail_pending(self, error: Exception) -> None:
        """The loop cannot go on: every request in flight gets an error now instead of a
        silence (`worker_lost` when a tensor-parallel rank is gone, else `internal_error`)."""
        lost = self.scheduler.tp_size > 1
        code = ErrorCode.WORKER_LOST if lost else ErrorCode.INTERNAL_ERROR
        message = f"{'a tensor-parallel rank is gone' if lost else 'the runtime failed'}: {error}"
        for client in self.clients.values():
            self.reply(client.identity, error_reply(client.rid, code, message))
        self.clients.clear()
        self.front.close(linger=1000)  # the errors leave before the process does
        self.ctx.term()

    def _drain(self, block: bool) -> None:
        waits = self.scheduler.stalled or bool(self.prompts.pending)  # on a compile, a text
        timeout = STALLED_POLL_MS if waits else IDLE_POLL_MS if block else 0
        self.front.drain(timeout)

    def _abort_vanished_clients(self) -> None:
        """A client whose connection dropped, or that pinged and then fell silent, loses its
        requests and pins."""
        gone = self.front.vanished({c.identity for c in self.clients.values()})
        if not gone:
            return
        self.prompts.forget(gone)
        for identity in gone:
            self.scheduler.unpin_all(_internal_rid(identity, ""))
        for req, client in list(self.clients.items()):
            if client.identity in gone:
                logger.info(
                    "client %s is gone; aborting its request %s",
                    client.identity.hex(),
                    client.rid,
                )
                self.scheduler.abort(req.rid)
                self.clients.pop(req, None)

    def _generate(self, caller: Caller, msg: dict[str, Any]) -> None:
        """Queue a generate; a refusal is counted by its code, then answered by the front."""
        try:
            self._queue(caller, msg)
        except RequestError as e:
            self.metrics.error(e.code.value)
            raise
        except ValueError:
            self.metrics.error(ErrorCode.INVALID_REQUEST.value)
            raise

    def _queue(self, caller: Caller, msg: dict[str, Any]) -> None:
        identity, tenant = caller.identity, caller.principal.tenant
        rid = check_rid(msg.get("rid"))
        if self.drain_deadline is not None:
            raise RequestError(
                ErrorCode.DRAINING, "the server is shutting down; send this to another one"
            )
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            raise RequestError(
                ErrorCode.OVERLOADED,
                f"{len(self.scheduler.waiting)} requests are already waiting; try again later",
            )
        unknown = sorted(map(str, set(msg) - GENERATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown generate fields: {unknown}")
        stream = msg.get("stream", False)
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be true or false, got {stream!r}")
        params = msg.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ValueError("sampling_params must be a map")
        params = SamplingParams.from_dict(params, self.scheduler.sampling_defaults)
        scope = RequestScope.from_fields(tenant, msg).capped(
            self._priority_cap(caller.principal), self.args.schedule_low_priority_values_first
        )
        limit_key = _limit_key(identity, tenant)
        self._check_limits(limit_key, tenant, params.n, 0)  # before a long text is tokenized
        ids = self.prompts.ids(caller, msg)
        if ids is None:  # a long text, being tokenized: this runs again when it is
            return
        self._check_limits(limit_key, tenant, params.n, params.n * len(ids))
        if any(c.identity == identity and c.rid == rid for c in self.clients.values()):
            raise ValueError(f"rid {rid!r} is already in flight on this connection")
        # rids are the client's own: two clients may both use "r1"
        base = _internal_rid(identity, rid)
        rids = [base] if params.n == 1 else [f"{base}-{i}" for i in range(params.n)]
        reqs = [
            self.scheduler.make_request(r, ids, params, sample_index=i, scope=scope)
            for i, r in enumerate(rids)
        ]
        for i, req in enumerate(reqs):
            self.clients[req] = ClientRequest(identity, rid, stream, i, limit_key)
            self.scheduler.add_request(req)

    def _priority_cap(self, principal: Principal) -> int | None:
        """The most urgent priority `principal` may ask for: its key-file line's `maxprio`,
        else `--tenant-max-priority` for any key but the admin's (None: no cap)."""
        if principal.max_priority is not None or principal.admin:
            return principal.max_priority
        return self.args.tenant_max_priority

    def _check_limits(self, limit_key: str, tenant: str, requests: int, tokens: int) -> None:
        """Refuse with `rate_limited` a generate that would take its tenant (or connection) past
        its in-flight requests or waiting prompt tokens (`TenantCaps`); other tenants are not
        affected."""
        most_requests = self.tenant_caps.requests
        most_tokens = self.tenant_caps.queued_tokens
        if most_requests is None and most_tokens is None:
            return
        mine = [req for req, c in self.clients.items() if c.limit_key == limit_key]
        waiting = {id(r) for r in self.scheduler.waiting}
        queued = sum(len(r.input_ids) for r in mine if id(r) in waiting)
        if most_requests is not None and len(mine) + requests > most_requests:
            problem = f"{len(mine)} requests in flight (at most {most_requests})"
        elif most_tokens is not None and queued + tokens > most_tokens:
            problem = f"{queued} prompt tokens queued, {tokens} more asked (at most {most_tokens})"
        else:
            return
        self.scheduler.tenants.of(tenant).rate_limited += 1
        raise RequestError(ErrorCode.RATE_LIMITED, f"{problem}; try again later")

    # ---- replies -----------------------------------------------------------------------------
    def publish(self, reqs: list[Req]) -> None:
        """Send what `reqs` (a step's, an abort's) have new to their clients: a stream's delta,
        a finished request's final reply (then it is forgotten here). Ops outside this module
        (rollout's weight updates) publish what they end through it."""
        for req in reqs:
            if req not in self.clients:
                continue
            client = self.clients[req]
            self._observe_tokens(client, req)
            if client.stream:
                self._send_delta(client, req)
            if req.finished:
                del self.clients[req]
                self._observe_end(req)
                self.reply(client.identity, _final_reply(client, req))

    def _observe_tokens(self, client: ClientRequest, req: Req) -> None:
        """One ITL sample per gap between two steps that gave `req` tokens (several tokens from
        one step, a verified draft or a forced jump, are one gap, as vLLM counts them)."""
        if len(req.output_ids) > client.tokens_seen:
            now = time.monotonic()
            if client.last_token_at is not None:
                self.metrics.itl.observe(now - client.last_token_at)
            client.tokens_seen, client.last_token_at = len(req.output_ids), now

    def _observe_end(self, req: Req) -> None:
        """A finished request's latencies and its finish reason, or its error code."""
        reason, m = req.finish_reason, self.metrics
        assert reason is not None, "a finished request has its reason"
        if reason.error is not None:
            m.error(reason.error.value)
        else:
            m.finish(reason.type)
        m.e2e.observe((req.finish_time or time.monotonic()) - req.arrival)
        if req.first_token_time is not None:
            m.ttft.observe(req.first_token_time - req.arrival)
        if req.admitted_at is not None:
            m.queue_time.observe(req.admitted_at - req.arrival)

    def _send_delta(self, client: ClientRequest, req: Req) -> None:
        text_end = len(req.text) if req.finished else len(req.text) - req.stop_holdback()
        delta, ids = req.text[client.text_sent : text_end], req.output_ids[client.ids_sent :]
        if delta or ids:
            client.text_sent, client.ids_sent = max(text_end, client.text_sent), len(req.output_ids)
            self.reply(
                client.identity,
                {
                    "rid": client.rid,
                    "index": client.index,
                    "finished": False,
                    "delta": delta,
                    "token_ids": ids,
                },
            )

    def reply(self, identity: bytes, msg: dict[str, Any]) -> None:
        """Send `msg` to the client connection `identity` (through the front's bounds)."""
        self.front.reply(identity, msg)


def _final_reply(client: ClientRequest, req: Req) -> dict[str, Any]:
    """The last message of a request: its result, or its error (`internal_error` when even
    the result cannot be built, so the client is never left waiting)."""
    reason = req.finish_reason
    assert reason is not None, "a finished request has its reason"
    if reason.error is not None:
        return error_reply(client.rid, reason.error, reason.message or reason.error.value)
    try:
        return {"rid": client.rid, "index": client.index, "finished": True, **req.result()}
    except Exception as e:
        logger.exception("the result of request %s could not be built", req.rid)
        return error_reply(client.rid, ErrorCode.INTERNAL_ERROR, internal_error_text(e))


def _internal_rid(identity: bytes, rid: str) -> str:
    return f"{identity.hex()}/{rid}"


def _limit_key(identity: bytes, tenant: str) -> str:
    """Whom per-tenant limits count: a key file's tenant, else the client connection."""
    return f"tenant:{tenant}" if tenant else f"client:{identity.hex()}"


def _model_info(server: Server, caller: Caller, op: ModelInfo, rid: Any) -> dict[str, Any]:
    tok, info = server.tokenizer, server.scheduler.model_info()
    return {
        "model": server.args.model_name,
        "model_path": str(info.model_path),
        "tokenizer_path": str(info.tokenizer_path),
        "tokenizer_class": type(tok).__name__,
        "context_length": info.context_length,
        "chat_template": tok.chat_template,
        "special_tokens": {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)},
        "eos_token_ids": info.eos_token_ids,
        "vocab_size": info.vocab_size,
        "weights": asdict(info.weights),
        "sampling_defaults": info.sampling_defaults,
        "lora_enabled": server.args.executor.lora_enabled,
        "cpu_isa": info.cpu_isa,
        "embedding": info.embedding,
        **asdict(info.kv),
        "quantization": info.quantization,
        "quantization_reason": info.quantization_reason,
        "weight_version": server.scheduler.weight_version,
    }


def _shutdown(server: Server, caller: Caller, op: Shutdown, rid: Any) -> bool:
    server.running = False
    return True


def _pin(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """Pin a cached prefix under a `pin_id` of the caller's connection, on its tenant's quota
    (`Scheduler.pin`); answered here, once a long text is tokenized."""
    pin_id = msg.get("pin_id")
    if not isinstance(pin_id, str) or not 0 < len(pin_id) <= MAX_PIN_ID_CHARS:
        raise ValueError(f"pin needs a pin_id: a string of 1 to {MAX_PIN_ID_CHARS} characters")
    scope = server.scheduler.with_adapter(RequestScope.from_fields(caller.principal.tenant, msg))
    ids = server.prompts.ids(caller, msg)
    if ids is None:
        return
    tokens = server.scheduler.pin(
        _internal_rid(caller.identity, pin_id),
        ids,
        scope.salt,
        owner=_limit_key(caller.identity, caller.principal.tenant),
    )
    server.reply(caller.identity, {"rid": msg.get("rid"), "result": tokens})


def _load_lora(server: Server, caller: Caller, op: LoadLoraAdapter, rid: Any) -> dict[str, Any]:
    return asdict(server.scheduler.load_lora(op.lora_name, op.lora_path))


def _unload_lora(server: Server, caller: Caller, op: UnloadLoraAdapter, rid: Any) -> bool:
    server.scheduler.unload_lora(op.lora_name)
    return True


def _list_lora(
    server: Server, caller: Caller, op: ListLoraAdapters, rid: Any
) -> list[dict[str, Any]]:
    return [asdict(a) for a in server.scheduler.lora_adapters()]


def _unpin(server: Server, caller: Caller, op: Unpin, rid: Any) -> bool:
    return server.scheduler.unpin(_internal_rid(caller.identity, op.pin_id))


def _tokenize(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """A text's token ids as a prompt's (`add_special_tokens`, default true: the model's BOS
    as a generate request's text gets it; false: the text's own tokens); answered here, once a
    long text is tokenized."""
    if not isinstance(msg.get("text"), str):
        raise ValueError("tokenize needs a string text")
    special = msg.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ValueError("add_special_tokens must be a boolean")
    ids = server.prompts.ids(caller, msg, special)
    if ids is not None:
        server.reply(caller.identity, {"rid": msg.get("rid"), "result": ids})


def _stats(server: Server, caller: Caller, op: ControlOp, rid: Any) -> dict[str, Any]:
    stats = {**server.scheduler.stats(), "draining": server.drain_deadline is not None}
    return visible_stats(stats, caller.principal)


def _metrics(server: Server, caller: Caller, op: Metrics, rid: Any) -> str:
    """This runtime's Prometheus text as the caller may see it (`RuntimeMetrics.render`)."""
    return server.metrics.render(_stats(server, caller, op, rid), admin=caller.principal.admin)


def _abort(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    server.publish(server.scheduler.abort(_internal_rid(caller.identity, str(msg.get("rid")))))


# each control op's handler (`protocol.CONTROL_OPS`, every one: a test checks), taking the
# server first (bound in Server.__init__); those that wait (`ControlOp.waits`) answer later
CONTROL: dict[type[ControlOp], Callable[..., Any]] = {
    Health: lambda s, c, op, rid: True,
    Ping: lambda s, c, op, rid: {"server_id": s.server_id},
    Stats: _stats,
    Metrics: _metrics,
    ModelInfo: _model_info,
    Unpin: _unpin,
    ListLoraAdapters: _list_lora,
    LoadLoraAdapter: _load_lora,
    UnloadLoraAdapter: _unload_lora,
    FlushCache: lambda s, c, op, rid: s.scheduler.flush_cache(),
    CheckInvariants: lambda s, c, op, rid: s.scheduler.check_invariants() or True,
    MemorySnapshot: lambda s, c, op, rid: s.scheduler.memory_snapshot(),
    Shutdown: _shutdown,
    **rollout.HANDLERS,
}
# the runtime's op table: generate and the request ops, then the control ops
OPS: dict[str, Op] = {
    "generate": Op(Server._generate, answers=False),
    "abort": Op(_abort, answers=False),
    "tokenize": Op(_tokenize, answers=False),
    "pin": Op(_pin, answers=False),
    **{r.op: Op(run, r, answers=not r.waits) for r, run in CONTROL.items()},
}


def serve(args: ServerArgs) -> None:
    """Load the model, bind, and run the loop until it stops (`launch.run_server` starts the
    gateway first)."""
    server = Server(args, args.endpoint)

    def stop(*_: Any) -> None:
        server.running = False

    signal.signal(signal.SIGTERM, lambda *_: server.begin_drain())
    signal.signal(signal.SIGINT, stop)
    http = "" if args.disable_http else f" (HTTP on http://{args.http_host}:{args.port})"
    logger.info("serving on %s%s", args.endpoint, http)
    try:
        server.serve_forever()
    except Exception as e:  # a bug in the loop, or a lost rank: logged, said to every client
        logger.exception("the serving loop failed")
        server.fail_pending(e)
        raise
