"""Client side of the wire protocol: one DEALER socket, many requests in flight, any thread."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Generator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError  # TimeoutError's from 3.11
from typing import Any, TypeVar

import msgpack
import zmq

from radixrt.protocol import ADMIN_KEYED_OPS, ErrorCode, error_reply

# ping period while requests are in flight; the runtime aborts a silent client's requests
HEARTBEAT_S = 1.0


class RemoteError(RuntimeError):
    """A failure the runtime reported for one request; `.code` is its stable `ErrorCode` value
    (a plain string for a code this client does not know), `.message` the runtime's words."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class InvalidRequestError(RemoteError, ValueError):
    """The request itself is wrong (a field, a constraint, a prompt too long); resending it fails again."""


class AuthenticationError(RemoteError, PermissionError):
    pass


class ConnectionLostError(RemoteError, ConnectionError):
    pass


class FrameTooLargeError(InvalidRequestError):
    """The request packs to more bytes than the runtime takes in one frame (its
    `--max-frame-bytes`): refused here, before sending, since the runtime would drop this
    client's whole connection (every request in flight on it) for such a frame."""

    def __init__(self, size: int, limit: int):
        super().__init__(
            ErrorCode.INVALID_REQUEST.value,
            f"the request packs to {size} bytes; the runtime takes at most {limit} bytes in "
            "one frame (--max-frame-bytes)",
        )
        self.size, self.limit = size, limit


class ReplyTimeoutError(RemoteError, TimeoutError):
    """The runtime sent no reply to a request or call within the wait it was given (code
    `timeout`); the request is aborted."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.TIMEOUT.value, message)


_ERROR_CLASSES = {
    ErrorCode.INVALID_REQUEST: InvalidRequestError,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: InvalidRequestError,
    ErrorCode.INVALID_CONSTRAINT: InvalidRequestError,
    ErrorCode.UNAUTHORIZED: AuthenticationError,
    ErrorCode.CONNECTION_LOST: ConnectionLostError,
    ErrorCode.WORKER_LOST: ConnectionLostError,
}


def raise_for(reply: dict[str, Any]) -> None:
    err = reply.get("error")
    if err:
        code = err.get("code") or err.get("type")
        known = ErrorCode.parse(code)
        kind = _ERROR_CLASSES.get(known, RemoteError) if known is not None else RemoteError
        raise kind(code, err.get("message"))


class RuntimeClient:
    """Talks to a runtime's ROUTER socket.

    A single I/O thread owns the DEALER socket (ZeroMQ sockets are not thread-safe); callers hand
    it frames through per-thread inproc PUSH sockets and get replies through callbacks. While
    requests are in flight it pings the runtime: a runtime that restarted (new `server_id`) or
    went silent for `dead_after_s` fails those requests with a clear `connection_lost` error;
    the socket reconnects by itself, so later requests work again. Control ops, and the ops of
    which the admin sees more (`protocol.ADMIN_KEYED_OPS`: `stats`, `model_info`, ...), go with
    `admin_api_key` when one is given, everything else with `api_key`.
    It also pings while it holds pins, which the runtime drops with a silent client.

    A message that cannot be packed (an integer past 64 bits) or that packs past
    `max_frame_bytes` (the runtime's `--max-frame-bytes`; None: unchecked) is refused in the
    calling thread with `InvalidRequestError` / `FrameTooLargeError` before anything is sent or
    registered.
    """

    def __init__(
        self,
        endpoint: str,
        api_key: str | None = None,
        curve_server_key: str | None = None,
        dead_after_s: float = 120.0,
        admin_api_key: str | None = None,
        curve_client_secret_key: str | None = None,
        max_frame_bytes: int | None = None,
    ):
        self.endpoint = endpoint
        self.max_frame_bytes = max_frame_bytes
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.curve_client_secret_key = curve_client_secret_key
        self.curve_server_key = curve_server_key
        self.dead_after_s = dead_after_s
        self._ctx = zmq.Context()
        self._inproc = f"inproc://radixrt-client-{uuid.uuid4().hex}"
        self._local = threading.local()
        self._pending: dict[str, Callable[[dict[str, Any]], object]] = {}
        self._pins: set[str] = set()  # pin ids held on the runtime: keep pinging while any
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._server_id: str | None = None
        self._last_heard = time.monotonic()
        started = threading.Event()
        self._io = threading.Thread(
            target=self._io_loop, args=(started,), name="radixrt-client-io", daemon=True
        )
        self._io.start()
        started.wait()

    # ---- calls -------------------------------------------------------------------------------
    def call(self, op: str, timeout: float | None = None, **fields: Any) -> Any:
        """A control op (stats, health, flush_cache, ...): its result, or the error raised."""
        future: Future[dict[str, Any]] = Future()
        rid = f"ctl-{uuid.uuid4().hex}"
        if op in ADMIN_KEYED_OPS and self.admin_api_key is not None:
            fields = {"api_key": self.admin_api_key, **fields}
        frame = self.encode({"op": op, "rid": rid, **fields})

        def answer(reply: dict[str, Any]) -> None:
            if not future.done():
                future.set_result(reply)

        self._register(rid, answer)
        try:
            self._push(frame)
            reply = future.result(timeout)
        except FutureTimeoutError:
            raise ReplyTimeoutError(f"the runtime did not answer {op} within {timeout}s") from None
        finally:
            self._forget(rid)
        raise_for(reply)
        self._track_pin(op, fields.get("pin_id"))
        return reply.get("result")

    def submit(self, **fields: Any) -> Submission:
        """Send one generate op now; read its replies from the returned handle."""
        return self._submit(Submission, fields)

    def submit_async(self, **fields: Any) -> AsyncSubmission:
        return self._submit(AsyncSubmission, fields)

    def _submit(self, kind: type[_S], fields: dict[str, Any]) -> _S:
        """Pack first: a request that cannot be sent is refused before it is registered."""
        fields.setdefault("rid", uuid.uuid4().hex)
        frame = self.encode({"op": "generate", **fields})
        sub = kind(self, fields["rid"], _num_samples(fields))
        self._register(sub.rid, sub.deliver)
        try:
            self._push(frame)
        except BaseException:
            self._forget(sub.rid)
            raise
        return sub

    def abort(self, rid: str) -> None:
        self.send({"op": "abort", "rid": rid})

    def close(self) -> None:
        """Abort what is still in flight, then close the socket."""
        if self._closed.is_set():
            return
        with self._lock:
            rids = [r for r in self._pending if not r.startswith("ctl-")]
        for rid in rids:
            self.abort(rid)
        time.sleep(0.05 if rids else 0)  # let the I/O thread flush the aborts
        self._closed.set()
        self._io.join(timeout=5)
        if not self._io.is_alive():  # never pull sockets from under a running thread
            self._ctx.destroy(linger=0)  # also closes the callers' thread-local PUSH sockets

    @property
    def in_flight(self) -> int:
        """Requests and calls registered and not yet finished or given up."""
        with self._lock:
            return len(self._pending)

    # ---- plumbing ----------------------------------------------------------------------------
    def _register(self, rid: str, deliver: Callable[[dict[str, Any]], object]) -> None:
        with self._lock:
            if not self._pending:
                self._last_heard = time.monotonic()
            self._pending[rid] = deliver

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def send(self, msg: dict[str, Any]) -> None:
        self._push(self.encode(msg))

    def encode(self, msg: dict[str, Any]) -> bytes:
        """`msg` as one frame (with this client's key unless it has its own), or the
        `InvalidRequestError` that says why it cannot go."""
        if self.api_key is not None:
            msg = {"api_key": self.api_key, **msg}  # a request's own key wins
        try:
            frame: bytes = msgpack.packb(msg, use_bin_type=True)
        except (OverflowError, TypeError, ValueError) as e:  # 2**64, a set, nesting past 512
            hint = " (integers must fit in 64 bits)" if isinstance(e, OverflowError) else ""
            raise InvalidRequestError(
                ErrorCode.INVALID_REQUEST.value, f"the request cannot be packed: {e}{hint}"
            ) from None
        if self.max_frame_bytes is not None and len(frame) > self.max_frame_bytes:
            raise FrameTooLargeError(len(frame), self.max_frame_bytes)
        return frame

    def _push(self, frame: bytes) -> None:
        """Hand a frame to the I/O thread (this thread's own inproc socket)."""
        if self._closed.is_set():
            raise ConnectionError("the client is closed")
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._inproc)
        push.send(frame)

    def _track_pin(self, op: str, pin_id: Any) -> None:
        """Remember the pins this client holds: the runtime drops a client's pins once it
        falls silent after pinging, so the I/O thread pings while any is held."""
        if not isinstance(pin_id, str):
            return
        with self._lock:
            if op == "pin":
                self._pins.add(pin_id)
            elif op == "unpin":
                self._pins.discard(pin_id)

    def _io_loop(self, started: threading.Event) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if self.curve_server_key:
            dealer.curve_publickey, dealer.curve_secretkey = _client_keypair(
                self.curve_client_secret_key
            )
            dealer.curve_serverkey = self.curve_server_key.encode()
        dealer.connect(self.endpoint)
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._inproc)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        started.set()
        next_ping = 0.0
        # Never block on the DEALER: with no live peer (runtime down, handshake refused) a send
        # would wait forever, so frames wait here and go out when a peer takes them.
        outbox: deque[bytes] = deque()
        while not self._closed.is_set():
            for sock, _ in poller.poll(100):
                if sock is pull:
                    outbox.append(pull.recv())
                else:
                    self._dispatch(msgpack.unpackb(dealer.recv(), raw=False))
            now = time.monotonic()
            if (self._pending or self._pins) and now >= next_ping and not outbox:
                next_ping = now + HEARTBEAT_S
                ping = {"op": "ping", "rid": "ping"}
                outbox.append(
                    msgpack.packb({**ping, "api_key": self.api_key} if self.api_key else ping)
                )
            while outbox:
                try:
                    dealer.send(outbox[0], zmq.NOBLOCK)
                except zmq.Again:
                    break
                outbox.popleft()
            if self._pending and now - self._last_heard > self.dead_after_s:
                self.fail_pending(
                    f"no reply from the runtime at {self.endpoint} for {self.dead_after_s:.0f}s"
                )
        dealer.close()
        pull.close()

    def _dispatch(self, reply: dict[str, Any]) -> None:
        self._last_heard = time.monotonic()
        rid = reply.get("rid")
        if rid == "ping":
            server_id = (reply.get("result") or {}).get("server_id")
            if self._server_id is not None and server_id != self._server_id:
                self.fail_pending(
                    f"the runtime at {self.endpoint} restarted; requests in flight were lost"
                )
                with self._lock:
                    self._pins.clear()  # and its pins with them
            self._server_id = server_id
            return
        with self._lock:
            deliver = self._pending.get(rid) if isinstance(rid, str) else None
        if deliver is not None:
            deliver(reply)

    def fail_pending(self, message: str) -> None:
        """End every request in flight with a `connection_lost` error saying `message`."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, deliver in pending.items():
            deliver(error_reply(rid, ErrorCode.CONNECTION_LOST, message))


def _client_keypair(secret: str | None) -> tuple[bytes, bytes]:
    """This client's CURVE key pair: the given secret's (a server's `--curve-client-keys` lists
    its public key), else an ephemeral one."""
    if secret is None:
        return zmq.curve_keypair()
    return zmq.curve_public(secret.encode()), secret.encode()


_S = TypeVar("_S", bound="_Submission")


def _num_samples(fields: dict[str, Any]) -> int:
    n = (fields.get("sampling_params") or {}).get("n", 1)
    return n if isinstance(n, int) and n > 0 else 1


class _Submission:
    """The replies of one generate op; aborts the request if abandoned before it finished."""

    def __init__(self, client: RuntimeClient, rid: str, n: int):
        self.client, self.rid, self.n = client, rid, n
        self.finished = 0
        self.closed = False
        # hands a reply over to the reader (from the I/O thread); each kind sets its own
        self.deliver: Callable[[dict[str, Any]], object]

    def _accept(self, reply: dict[str, Any]) -> dict[str, Any]:
        raise_for(reply)
        self.finished += bool(reply.get("finished"))
        return reply

    def close(self) -> None:
        """Stop listening for its replies, and abort it unless it finished; once."""
        if self.closed:
            return
        self.closed = True
        self.client._forget(self.rid)
        if self.finished < self.n:
            self.client.abort(self.rid)

    def _timed_out(self, timeout: float | None) -> ReplyTimeoutError:
        return ReplyTimeoutError(
            f"the runtime sent no reply to request {self.rid} within {timeout}s"
        )


class Submission(_Submission):
    def __init__(self, client: RuntimeClient, rid: str, n: int):
        super().__init__(client, rid, n)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.deliver = self._replies.put

    def replies(self, timeout: float | None = None) -> Generator[dict[str, Any], None, None]:
        try:
            while self.finished < self.n:
                try:
                    yield self._accept(self._replies.get(timeout=timeout))
                except queue.Empty:
                    raise self._timed_out(timeout) from None
        finally:
            self.close()

    def finals(self, timeout: float | None = None) -> list[dict[str, Any]]:
        finals = [r for r in self.replies(timeout) if r.get("finished")]
        return sorted(finals, key=lambda r: r.get("index", 0))


class AsyncSubmission(_Submission):
    """The same for asyncio: replies cross from the I/O thread into the caller's event loop."""

    def __init__(self, client: RuntimeClient, rid: str, n: int):
        super().__init__(client, rid, n)
        self._loop = asyncio.get_running_loop()
        self._replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.deliver = lambda reply: self._loop.call_soon_threadsafe(
            self._replies.put_nowait, reply
        )

    async def replies(self, timeout: float | None = None) -> AsyncGenerator[dict[str, Any], None]:
        try:
            while self.finished < self.n:
                try:
                    reply = await asyncio.wait_for(self._replies.get(), timeout)
                except asyncio.TimeoutError:
                    raise self._timed_out(timeout) from None
                yield self._accept(reply)
        finally:
            self.close()

    async def finals(self, timeout: float | None = None) -> list[dict[str, Any]]:
        finals = [r async for r in self.replies(timeout) if r.get("finished")]
        return sorted(finals, key=lambda r: r.get("index", 0))
