"""`radixrt router`: the client protocol in front of several workers (`radixrt serve`s).

Clients see one runtime: the router binds a ROUTER socket, speaks docs/protocol.md unchanged, and
talks to each worker as a client over a DEALER socket. A generate goes to one worker, chosen by
the policy (cache-aware by default), under a router-made rid; the worker's replies come back with
the client's rid. Control ops fan out: `stats` sums, `metrics` joins the workers' Prometheus
texts (each labelled with its `worker`) and adds the router's own, `flush_cache` reaches every
worker.

One thread, one poll loop: forwarding a frame costs a poll wake-up and two msgpack passes. The
router holds no KV and no model, only each worker's approximate prefix trees (one per cache
namespace) and who asked what. SIGTERM drains it as it drains a runtime; a worker's reply is
checked as a client's frame is, so a malformed one costs at most the request it names.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from radixrt.config import RouterSettings, WorkerSettings
from radixrt.protocol import (
    CONTROL_OPS,
    WEIGHT_UPDATE_WAIT_S,
    ControlOp,
    ErrorCode,
    Fleet,
    GenerateOptions,
    Health,
    Ping,
    RequestError,
    Shutdown,
    Unpin,
    check_rid,
    error_reply,
    internal_error_text,
)
from radixrt.server.front import (
    Caller,
    ClientFront,
    FrontConfig,
    Op,
    check_prompt_size,
    visible_stats,
)
from radixrt.server.metrics import RouterCounts, merge_worker_metrics
from radixrt.server.router.gathers import GATHER_TIMEOUT_S, Gather, Gathers
from radixrt.server.router.pins import Pin, PinBook
from radixrt.server.router.policy import Route, RouteReason, make_policy
from radixrt.server.router.prefix_tree import Namespace, Prompt
from radixrt.server.router.stats import count, fleet_stats
from radixrt.server.router.worker import WorkerLink, reply_problem

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

POLL_MS = 100
HEARTBEAT_S = 1.0  # the router pings every worker this often (so workers also watch it)
# A worker answers pings between its steps, so silence must outlast its longest step (a first
# request compiles kernels; a busy 2-core machine takes seconds a prefill): a dead process is
# caught at once by its dropped connection, so this is only for hung or unreachable ones.
WORKER_SILENCE_S = 60.0
# A draining router waits this much past --drain-timeout: the workers end what is left at their
# own deadline, and their `draining` errors have this long to come back through the router.
DRAIN_SLACK_S = 5.0


@dataclass(frozen=True)
class RouterConfig:
    """What `radixrt router` and `serve --dp-size` run with: the workers (`fleet`: their
    addresses, the key and CURVE key the router sends them, their tokenizer), the policy
    (`routing`) and the clients' socket (`front`: keys, roles, CURVE, limits and the drain
    timeout: the runtime's rules).

    With a key file (`front.api_key_file`) the router forwards each client's own `api_key`, so
    the workers (which must accept the same keys: `serve --dp-size` passes them the file and the
    admin key) see the right tenant, priority cap and role; `fleet.worker_api_key` then only
    carries the router's own calls (pings, its stats). Without one, every message goes on with
    `fleet.worker_api_key`."""

    fleet: WorkerSettings  # at least one worker (`RouterArgs` checks it)
    routing: RouterSettings = field(default_factory=RouterSettings)
    front: FrontConfig = field(default_factory=FrontConfig)

    @property
    def forwards_client_keys(self) -> bool:
        return bool(self.front.api_key_file)


def namespace_of(tenant: str, msg: dict[str, Any]) -> Namespace:
    """The cache namespace a generate or pin from `tenant` is matched in: its tenant and the
    options naming a namespace (`cache_salt`, the LoRA adapter; the workers share a prefix only
    within one). A ValueError names a bad option, as the worker would."""
    return Namespace(tenant=tenant, **GenerateOptions.from_wire(msg).namespace())


@dataclass(eq=False)
class Flight:
    """A client's generate in flight at a worker; `started` once any reply reached the client,
    after which it can no longer be re-sent elsewhere."""

    identity: bytes
    rid: str  # the client's
    key: str  # the router's rid at the worker
    msg: dict[str, Any]  # as the client sent it, for a re-send
    prompt: Prompt
    samples: int
    worker: WorkerLink
    finished: int = 0
    started: bool = False


class Router:
    def __init__(self, config: RouterConfig, endpoint: str):
        self.config = config
        self.ctx = zmq.Context()
        self.front = ClientFront(self.ctx, endpoint, config.front, self._ops())
        self.workers = [
            WorkerLink(
                self.ctx,
                i,
                url,
                config.fleet.worker_api_key,
                config.fleet.worker_curve_server_key,
                config.front.max_frame_bytes,
            )
            for i, url in enumerate(config.fleet.worker)
        ]
        self.policy = make_policy(config.routing)
        self.worker_poller = zmq.Poller()  # what a startup waits on: the workers only
        self.poller = zmq.Poller()
        self.poller.register(self.front.sock, zmq.POLLIN)
        for w in self.workers:
            self._poll(w, on=True)
        self.flights: dict[str, Flight] = {}  # by key
        self.gathers = Gathers()
        self.pins = PinBook()
        self.counters = {f"routed_by_{r.value}": 0 for r in RouteReason}
        self.counters.update(resent_requests=0, lost_requests=0)
        tokenizer = config.fleet.tokenizer
        self.tokenizer = routing_tokenizer(tokenizer) if tokenizer else None
        self.server_id = uuid.uuid4().hex
        self._next_ping = 0.0
        self.running = True
        self.drain_deadline: float | None = None  # set by SIGTERM: refuse new work, finish old

    # ---- the loop ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Run the loop until shut down or drained; a turn that raises (a bug: frames and
        worker replies are each contained where they are handled) is logged and the loop goes
        on, since a router holds no state that a failed turn could leave out of step."""
        try:
            while self.running:
                try:
                    self._run_once()
                except Exception:
                    logger.exception("a turn of the router's loop failed; serving on")
        finally:
            self.close()

    def wait_for_workers(self, timeout: float) -> None:
        """Run the loop until every worker has answered; clients' frames wait in the socket
        meanwhile, so a launcher's first `health` is answered by a whole fleet."""
        deadline = time.monotonic() + timeout
        while not all(w.alive for w in self.workers) and time.monotonic() < deadline:
            self._run_once(serve_clients=False)

    def _run_once(self, serve_clients: bool = True) -> None:
        events = dict((self.poller if serve_clients else self.worker_poller).poll(POLL_MS))
        if self.front.sock in events:
            self.front.drain()
        for w in self.workers:
            if w.sock in events:
                self._read(w)
            if w.monitor in events:
                self._on_link_events(w)
        self._tick()
        if self.drain_deadline is not None:
            self._drain_step()

    def _read(self, worker: WorkerLink) -> None:
        for reply in worker.recv_all():
            self._handle_worker_reply(worker, reply)

    def _on_link_events(self, worker: WorkerLink) -> None:
        """A connection that came up is pinged at once; one that dropped is read to its end
        first (a worker's last replies precede its exit, though the poll may see the drop
        first: a drained worker's final chunks are answers, not losses), then taken out of
        rotation and its socket replaced."""
        was_connected = worker.connected
        if worker.watch():
            self._read(worker)
            if worker.alive:
                self._lose(worker, "its connection dropped")
            self._poll(worker, on=False)
            worker.reopen()
            self._poll(worker, on=True)
        elif worker.connected and not was_connected:
            worker.send({"op": "ping", "rid": "ping"})

    def _poll(self, worker: WorkerLink, on: bool) -> None:
        """Register `worker`'s socket and monitor with both pollers, or (not `on`) take them out."""
        for poller in (self.worker_poller, self.poller):
            for sock in (worker.sock, worker.monitor):
                if on:
                    poller.register(sock, zmq.POLLIN)
                else:
                    poller.unregister(sock)

    def begin_drain(self) -> None:
        """Stop taking generates (they get `draining`); the loop ends once every request in
        flight has finished, or `--drain-timeout` (plus `DRAIN_SLACK_S`) later, when the rest
        end with `draining`. The workers are not told: a fleet forwards the signal itself."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.config.front.drain_timeout + DRAIN_SLACK_S
            logger.info("draining: %d requests in flight", len(self.flights))

    def _drain_step(self) -> None:
        assert self.drain_deadline is not None, "only a draining router steps its drain"
        if (self.flights or self.gathers) and time.monotonic() < self.drain_deadline:
            return
        for flight in list(self.flights.values()):
            flight.worker.send({"op": "abort", "rid": flight.key})
            self._fail(flight, ErrorCode.DRAINING, "the router stopped (drain timeout) first")
        for gather in self.gathers.all():
            self._finish_gather(gather)
        logger.info("drained; stopping")
        self.running = False

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.front.close()
        self.ctx.term()

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + HEARTBEAT_S
            for w in self.workers:
                w.send({"op": "ping", "rid": "ping"})
        for w in self.workers:
            if w.alive and now - w.last_heard > WORKER_SILENCE_S:
                self._lose(w, f"silent for {WORKER_SILENCE_S:.0f}s")
        for gather in self.gathers.expired(now):
            self._finish_gather(gather)
        for identity in self.front.vanished({f.identity for f in self.flights.values()}):
            self._forget_client(identity)

    # ---- clients -----------------------------------------------------------------------------
    def _ops(self) -> dict[str, Op]:
        """The op table: generate and the request ops, and each control op as its declaration's
        `fleet` says (those the router answers itself, `Fleet.ROUTER`, have handlers here). The
        handlers reply themselves (now, or when the workers have) but where `answers`."""
        by_fleet = {
            Fleet.ALL: self._to_all,
            Fleet.ONE: self._to_one,
            Fleet.WORKERS_ONLY: _refuse_workers_only,
        }
        own: dict[type[ControlOp], Callable[..., Any]] = {  # each takes its own op's record
            Ping: lambda caller, op, rid: {"server_id": self.server_id},
            Health: self._health,
            Shutdown: self._shutdown,
            Unpin: self._unpin,
        }
        answered = {Ping, Shutdown}
        control = {
            r.op: Op(
                own[r] if r.fleet is Fleet.ROUTER else by_fleet[r.fleet],
                r,
                answers=r in answered or r.fleet is Fleet.WORKERS_ONLY,
            )
            for r in CONTROL_OPS.values()
        }
        return {
            "generate": Op(self._on_generate, answers=False),
            "abort": Op(self._abort, answers=False),
            "pin": Op(self._on_pin, answers=False),
            "tokenize": Op(self._ask_one, answers=False),
            **control,
        }

    def _for_workers(self, caller: Caller, msg: dict[str, Any]) -> dict[str, Any]:
        """`msg` as a worker gets it: with the client's own key when keys are forwarded (see
        RouterConfig), else as it is (the link adds `worker_api_key`)."""
        if self.config.forwards_client_keys and caller.api_key is not None:
            return {**msg, "api_key": caller.api_key}
        return msg

    def _on_generate(self, caller: Caller, msg: dict[str, Any]) -> None:
        self._generate(caller.identity, self._for_workers(caller, msg), caller.principal.tenant)

    def _on_pin(self, caller: Caller, msg: dict[str, Any]) -> None:
        self._pin(caller, self._for_workers(caller, msg))

    def _to_all(self, caller: Caller, op: ControlOp, rid: Any) -> None:
        msg = {"rid": rid, **op.wire()}
        self._fan_out(caller, self._for_workers(caller, msg), self._alive())

    def _to_one(self, caller: Caller, op: ControlOp, rid: Any) -> None:
        self._ask_one(caller, {"rid": rid, **op.wire()})

    def _ask_one(self, caller: Caller, msg: dict[str, Any]) -> None:
        """Send `msg` to one live worker (a tokenize, or an op the workers answer alike)."""
        self._fan_out(caller, self._for_workers(caller, msg), self._alive()[:1])

    def _abort(self, caller: Caller, msg: dict[str, Any]) -> None:
        flight = self.flights.get(_key(caller.identity, str(msg.get("rid"))))
        if flight is not None:
            flight.worker.send({"op": "abort", "rid": flight.key})

    def _health(self, caller: Caller, op: Health, rid: Any) -> None:
        if self._alive():
            self._reply(caller.identity, {"rid": rid, "result": True})
        else:
            self._reply(
                caller.identity, error_reply(rid, ErrorCode.WORKER_LOST, "no worker is alive")
            )

    def _shutdown(self, caller: Caller, op: Shutdown, rid: Any) -> bool:
        self.running = False
        return True

    def _unpin(self, caller: Caller, op: Unpin, rid: Any) -> None:
        pin = self.pins.pop(caller.identity, op.pin_id)
        if pin is None:
            self._reply(caller.identity, {"rid": rid, "result": False})
        else:
            msg = {"rid": rid, **op.wire()}
            self._fan_out(caller, msg, [self.workers[pin.worker]], pin_key=True)

    def _generate(self, identity: bytes, msg: dict[str, Any], tenant: str) -> None:
        """Route one client generate; `tenant` is whom its key names (the key, if forwarded, is
        in `msg`)."""
        rid = check_rid(msg.get("rid"))
        key = _key(identity, rid)
        if key in self.flights:
            raise ValueError(f"rid {rid!r} is already in flight on this connection")
        if self.drain_deadline is not None:
            raise RequestError(
                ErrorCode.DRAINING, "the router is shutting down; send this to another one"
            )
        params = msg.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ValueError("sampling_params must be a map")
        n = params.get("n", 1)
        samples = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        prompt = Prompt(namespace_of(tenant, msg), self._tokens(msg))
        flight = Flight(identity, rid, key, msg, prompt, samples, worker=None)  # type: ignore[arg-type]
        self._dispatch(flight)

    def _dispatch(self, flight: Flight, exclude: WorkerLink | None = None) -> None:
        """Send `flight` to the worker its pin or the policy picks; a worker that cannot take
        the frame is taken out and the next one tried; none left is `worker_lost`."""
        while True:
            candidates = [w for w in self._alive() if w is not exclude]
            if not candidates:
                self._reply(
                    flight.identity,
                    error_reply(flight.rid, ErrorCode.WORKER_LOST, "no worker is alive"),
                )
                self.counters["lost_requests"] += 1
                return
            route = self._route(flight, candidates)
            worker = route.worker
            if worker.send({**flight.msg, "rid": flight.key}):
                break
            self._lose(worker, "it does not take frames")
        flight.worker = worker
        worker.load += flight.samples - flight.finished
        worker.tree.insert(flight.prompt)
        self.flights[flight.key] = flight
        self.counters[f"routed_by_{route.reason.value}"] += 1

    def _route(self, flight: Flight, candidates: list[WorkerLink]) -> Route[WorkerLink]:
        for pin in self.pins.extended_by(flight.identity, flight.prompt):
            worker = self.workers[pin.worker]
            if worker in candidates:
                return Route(worker, RouteReason.PIN, len(pin.prompt.tokens))
        return self.policy.choose(flight.prompt, candidates)

    def _pin(self, caller: Caller, msg: dict[str, Any]) -> None:
        prompt = Prompt(namespace_of(caller.principal.tenant, msg), self._tokens(msg))
        candidates = self._alive()
        if not candidates:
            self._reply(
                caller.identity,
                error_reply(msg.get("rid"), ErrorCode.WORKER_LOST, "no worker is alive"),
            )
            return
        route = self.policy.choose(prompt, candidates)
        route.worker.tree.insert(prompt)
        self._fan_out(
            caller, msg, [route.worker], pin_key=True, pin=(str(msg.get("pin_id")), prompt)
        )

    def _tokens(self, msg: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the workers will see them ([] before the tokenizer is
        known: such a request is routed by load). Type errors are the client's."""
        text, ids = msg.get("text"), msg.get("input_ids")
        if (text is None) == (ids is None):
            raise ValueError("give exactly one of text or input_ids")
        check_prompt_size(msg, self.config.front.max_prompt_bytes)
        if text is not None:
            if not isinstance(text, str):
                raise ValueError("text must be a string")
            if self.tokenizer is None:
                return []
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("input_ids must be a list of ints")
        return ids

    def _forget_client(self, identity: bytes) -> None:
        """A pinging client fell silent: abort its requests and drop its pins, at the workers."""
        for flight in [f for f in self.flights.values() if f.identity == identity]:
            logger.info("client %s went silent; aborting %s", identity.hex(), flight.rid)
            flight.worker.send({"op": "abort", "rid": flight.key})
            self._end(flight)
        for pin_id, pin in self.pins.forget_client(identity).items():
            self.workers[pin.worker].send(
                {"op": "unpin", "rid": "unpin", "pin_id": _key(identity, pin_id)}
            )

    # ---- workers -----------------------------------------------------------------------------
    def _handle_worker_reply(self, worker: WorkerLink, reply: dict[str, Any]) -> None:
        """`_on_worker_reply`, where a bug costs the flight the reply names, never the router."""
        try:
            self._on_worker_reply(worker, reply)
        except Exception as e:
            logger.exception("worker %s: a reply could not be handled", worker.url)
            flight = self._flight_of(worker, reply.get("rid"))
            if flight is not None:
                self._fail(flight, ErrorCode.INTERNAL_ERROR, internal_error_text(e))

    def _on_worker_reply(self, worker: WorkerLink, reply: dict[str, Any]) -> None:
        """Route one reply by its rid: the router's own asks, a gather's part, or a flight's.
        What cannot be read is logged and dropped; a flight's malformed reply fails that flight
        with `internal_error` (and aborts it at the worker), a gather's stands as an error."""
        rid = reply.get("rid")
        if not isinstance(rid, str):
            worker.complain(f"dropped a reply whose rid is a {type(rid).__name__}, not a string")
            return
        own = rid in ("ping", "stats-self", "model-info-self")
        gather = self.gathers.part(rid, worker.index)
        problem = reply_problem(
            reply, result_map=own or (gather is not None and gather.op == "stats")
        )
        flight = self._flight_of(worker, rid)
        if own:
            self._on_own_reply(worker, rid, reply, problem)
        elif gather is not None:
            if problem is not None:
                reply = error_reply(None, ErrorCode.INTERNAL_ERROR, _malformed(worker, problem))
            if self.gathers.answer(rid, reply) is not None:
                self._finish_gather(gather)
        elif flight is not None and problem is not None:
            worker.send({"op": "abort", "rid": flight.key})
            self._fail(flight, ErrorCode.INTERNAL_ERROR, _malformed(worker, problem))
        elif flight is not None:
            self._relay(flight, reply)

    def _on_own_reply(
        self, worker: WorkerLink, rid: str, reply: dict[str, Any], problem: str | None
    ) -> None:
        """A reply to what the router asked for itself: a ping, the worker's stats (its pool
        bounds its tree), its model info (the tokenizer). A refusal (a wrong --worker-api-key)
        is logged like a malformed reply: the worker stays out of rotation until it answers."""
        error = reply.get("error")
        if problem is None and error is not None:
            problem = f"it refused: {error['code']}: {error['message']}"
        if problem is not None:
            worker.complain(f"dropped a {rid} reply: {problem}")
            return
        result = reply["result"]
        if rid == "ping":
            server_id = result.get("server_id")
            if isinstance(server_id, str):
                self._on_pong(worker, server_id)
            else:
                worker.complain("dropped a ping reply without a string server_id")
        elif rid == "stats-self":
            worker.stats = result
            total = count(result, "total_tokens") + count(result, "host_total_tokens")
            worker.tree.capacity = max(total, 1)
        else:
            self._on_model_info(result)

    def _flight_of(self, worker: WorkerLink, rid: object) -> Flight | None:
        """The flight `rid` names at `worker`, if any (a reply from another worker is stale)."""
        flight = self.flights.get(rid) if isinstance(rid, str) else None
        return flight if flight is not None and flight.worker is worker else None

    def _fail(self, flight: Flight, code: ErrorCode, message: str) -> None:
        self._reply(flight.identity, error_reply(flight.rid, code, message))
        self._end(flight)

    def _on_pong(self, worker: WorkerLink, server_id: str) -> None:
        if worker.alive and server_id != worker.server_id:
            self._lose(worker, "it restarted")
        if not worker.alive:
            logger.info("worker %s is in rotation", worker.url)
            worker.alive, worker.server_id = True, server_id
            worker.tree.clear()
            worker.send({"op": "stats", "rid": "stats-self"})
            if self.tokenizer is None:
                worker.send({"op": "model_info", "rid": "model-info-self"})

    def _on_model_info(self, info: dict[str, Any]) -> None:
        """Load the workers' tokenizer from the folder their `model_info` names, which a worker
        names to its admin key only (`--worker-api-key`; `serve --dp-size` gives the router
        one)."""
        folder = info.get("tokenizer_path") or info.get("model_path")
        path = Path(str(folder)) / "tokenizer.json"
        if self.tokenizer is not None:
            return
        if not folder:
            logger.warning(
                "the workers name no tokenizer path to --worker-api-key (not their admin key): "
                "routing by load until --tokenizer is given"
            )
        elif path.is_file():
            self.tokenizer = routing_tokenizer(str(path))
        else:
            logger.warning("no %s here: routing by load until --tokenizer is given", path)

    def _relay(self, flight: Flight, reply: dict[str, Any]) -> None:
        flight.started = True
        self._reply(flight.identity, {**reply, "rid": flight.rid})
        if reply.get("error"):
            self._end(flight)
        elif reply.get("finished"):
            flight.finished += 1
            flight.worker.load -= 1
            if flight.finished == flight.samples:
                # the worker's tree now holds the prompt and this output: so does its picture
                flight.worker.tree.insert(flight.prompt.extended(reply.get("output_ids") or []))
                self._end(flight)

    def _end(self, flight: Flight) -> None:
        flight.worker.load -= flight.samples - flight.finished
        flight.finished = flight.samples
        self.flights.pop(flight.key, None)

    def _lose(self, worker: WorkerLink, why: str) -> None:
        """Take `worker` out of rotation: requests it has not answered go to another worker,
        started streams end with `worker_lost`, fanned-out ops stop waiting for it."""
        # while draining, workers leaving is the plan
        level = logging.INFO if self.drain_deadline is not None else logging.WARNING
        logger.log(level, "worker %s is out of rotation: %s", worker.url, why)
        worker.alive = False
        worker.tree.clear()
        for flight in [f for f in self.flights.values() if f.worker is worker]:
            worker.send({"op": "abort", "rid": flight.key})  # in case it is only slow
            if flight.started:
                self.counters["lost_requests"] += 1
                self._fail(flight, ErrorCode.WORKER_LOST, f"worker {worker.url} is gone: {why}")
            else:
                self._end(flight)
                flight.finished = 0
                self.counters["resent_requests"] += 1
                self._dispatch(flight, exclude=worker)
        for gather in self.gathers.drop_worker(worker.index):
            self._finish_gather(gather)
        self.pins.forget_worker(worker.index)

    def _alive(self) -> list[WorkerLink]:
        return [w for w in self.workers if w.alive]

    # ---- fanned-out control ops --------------------------------------------------------------
    def _fan_out(
        self,
        caller: Caller,
        msg: dict[str, Any],
        workers: list[WorkerLink],
        pin_key: bool = False,
        pin: tuple[str, Prompt] | None = None,
    ) -> None:
        identity = caller.identity
        gather = Gather(
            identity,
            msg.get("rid"),
            str(msg.get("op")),
            time.monotonic()
            + (WEIGHT_UPDATE_WAIT_S if _waits(msg.get("op")) else GATHER_TIMEOUT_S),
            pin=pin,
            viewer=caller.principal,
        )
        if pin_key:  # pin ids are the client's own: two clients may both use "fork-1"
            msg = {**msg, "pin_id": _key(identity, str(msg.get("pin_id")))}
        self.gathers.send(gather, msg, workers)
        if not gather.waiting:
            self._finish_gather(gather)

    def _finish_gather(self, gather: Gather) -> None:
        self.gathers.close(gather)
        reply = self._combine(gather)
        if gather.identity is not None:
            self._reply(gather.identity, {**reply, "rid": gather.rid})

    def _combine(self, gather: Gather) -> dict[str, Any]:
        replies = [gather.replies[i] for i in sorted(gather.replies)]
        errors = [r for r in replies if r.get("error")]
        if gather.op == "stats":
            for i, r in gather.replies.items():
                if r.get("error") is None:  # else its last good stats stand
                    self.workers[i].stats = r["result"]
            return {"result": visible_stats(self._stats(), gather.viewer)}
        if gather.op == "metrics":
            return {"result": self._metrics(gather)}
        if errors:
            return errors[0]
        if not replies:
            return error_reply(None, ErrorCode.WORKER_LOST, "no worker answered")
        results = [r.get("result") for r in replies]
        if _waits(gather.op):  # new weights: the workers forgot their caches, so does the router
            for i in gather.replies:
                self.workers[i].tree.clear()
        if gather.op == "flush_cache":
            if all(results):
                for i in gather.replies:
                    self.workers[i].tree.clear()
            return {"result": all(results)}
        if gather.op == "check_invariants":
            return {"result": True}
        if gather.op == "memory_snapshot":
            return {"result": {"workers": results}}
        if gather.op == "pin" and gather.pin is not None:
            (index,) = gather.replies
            pin_id, prompt = gather.pin
            assert gather.identity is not None, "a pin is a client's"
            self.pins.add(gather.identity, pin_id, Pin(index, prompt))
        record = CONTROL_OPS.get(gather.op)  # the worker may have been asked with the admin's key
        result = results[0] if record is None else record.seen_by(results[0], gather.viewer.admin)
        return {"result": result}

    def _metrics(self, gather: Gather) -> str:
        """The workers' texts that came back, then the router's own counters."""
        texts = {i: r["result"] for i, r in gather.replies.items() if r.get("error") is None}
        counts = RouterCounts(dict(self.counters), len(self.workers), len(self._alive()))
        return merge_worker_metrics(texts, counts, gather.viewer)

    def _stats(self) -> dict[str, Any]:
        """Sums over the workers that answered, the ratios recomputed from the sums, each
        worker's own stats, and the policy's counters."""
        return {
            **fleet_stats([w.stats for w in self.workers if w.alive and w.stats]),
            "dp_size": len(self.workers),
            "router_policy": self.policy.name,
            "draining": self.drain_deadline is not None,
            **self.counters,
            "workers": [w.describe() for w in self.workers],
        }

    def _reply(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.front.reply(identity, msg)


def _key(identity: bytes, rid: str) -> str:
    return f"{identity.hex()}/{rid}"


def _malformed(worker: WorkerLink, problem: str) -> str:
    """Log that `worker` sent a malformed reply; the message the request it named gets."""
    worker.complain(f"a malformed reply: {problem}")
    return f"worker {worker.url} sent a malformed reply: {problem}"


def routing_tokenizer(path: str) -> Tokenizer:
    """The tokenizer.json at `path`, as the router encodes prompts with it (to find their
    cached prefixes): without padding or truncation."""
    from tokenizers import Tokenizer  # transformers' own fast tokenizer, without torch

    tokenizer = Tokenizer.from_file(path)
    # a file's padding would pad every text it encodes (a fixed length of 10^8 pads "hello"
    # to 10^8 ids), its truncation cut the prompt the route is chosen by: as transformers does
    # when it encodes without padding, neither applies
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _refuse_workers_only(caller: Caller, op: ControlOp, rid: Any) -> None:
    raise ValueError(
        f"{op.op} goes to each worker itself (each joins the trainer's group as its own "
        "rank_offset), not through a router"
    )


def _waits(op: object) -> bool:
    """Whether `op` waits on the workers' requests in flight (a weight update), so its gather
    waits longer."""
    record = CONTROL_OPS.get(op) if isinstance(op, str) else None
    return record is not None and record.waits
