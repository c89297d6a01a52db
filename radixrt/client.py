"""Client side of the wire protocol: one DEALER socket, many requests in flight, any thread."""

from __future__ import annotations

import itertools
import queue
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Iterator

import msgpack
import zmq

ERROR_TYPES = {"invalid_request": ValueError, "unknown_op": ValueError, "bad_message": ValueError}


class RemoteError(RuntimeError):
    """A failure the runtime reported for one request."""


def _raise_for(reply: dict[str, Any]) -> None:
    err = reply.get("error")
    if err:
        cls = ERROR_TYPES.get(err.get("type"), RemoteError)
        raise cls(f"{err.get('type')}: {err.get('message')}")


class RuntimeClient:
    """Talks to a runtime's ROUTER socket.

    A single I/O thread owns the DEALER socket (ZeroMQ sockets are not thread-safe); callers hand
    it frames through per-thread inproc PUSH sockets and receive replies through futures/queues.
    """

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._inproc = f"inproc://radixrt-client-{uuid.uuid4().hex}"
        self._local = threading.local()
        self._pending: dict[str, Future | queue.Queue] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = threading.Event()
        started = threading.Event()
        self._io = threading.Thread(target=self._io_loop, args=(started,), name="radixrt-client-io", daemon=True)
        self._io.start()
        started.wait()

    # ---- calls -------------------------------------------------------------------------------
    def call(self, op: str, timeout: float | None = None, **fields: Any) -> Any:
        """A control op (stats, health, flush_cache, ...): its result, or the error raised."""
        reply = self._request({"op": op, **fields}).result(timeout)
        _raise_for(reply)
        return reply.get("result")

    def submit(self, **fields: Any) -> "Submission":
        """Send one generate op now; read its replies from the returned handle."""
        rid = fields.setdefault("rid", uuid.uuid4().hex)
        replies: queue.Queue = queue.Queue()
        self._register(rid, replies)
        self._send({"op": "generate", **fields})
        return Submission(self, rid, (fields.get("sampling_params") or {}).get("n", 1), replies)

    def stream(self, timeout: float | None = None, **fields: Any) -> Iterator[dict[str, Any]]:
        """Yield every reply of one generate op (deltas, then one final map per sample)."""
        return self.submit(**fields).replies(timeout)

    def generate(self, timeout: float | None = None, **fields: Any) -> list[dict[str, Any]]:
        """The final reply of every sample (n of them), in sample order."""
        return self.submit(**{**fields, "stream": False}).finals(timeout)

    def abort(self, rid: str) -> None:
        self._send({"op": "abort", "rid": rid})

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._io.join(timeout=5)
            self._ctx.destroy(linger=0)  # also closes the callers' thread-local PUSH sockets

    # ---- plumbing ----------------------------------------------------------------------------
    def _forget(self, rid: str) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def _request(self, msg: dict[str, Any]) -> Future:
        rid = f"ctl-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        future: Future = Future()
        self._register(rid, future)
        self._send({**msg, "rid": rid})
        return future

    def _register(self, rid: str, sink: Future | queue.Queue) -> None:
        with self._lock:
            self._pending[rid] = sink

    def _send(self, msg: dict[str, Any]) -> None:
        if self._closed.is_set():
            raise RemoteError("the client is closed")
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._inproc)
        push.send(msgpack.packb(msg, use_bin_type=True))

    def _io_loop(self, started: threading.Event) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._inproc)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        started.set()
        while not self._closed.is_set():
            for sock, _ in poller.poll(100):
                if sock is pull:
                    dealer.send(pull.recv())
                else:
                    self._dispatch(msgpack.unpackb(dealer.recv(), raw=False))
        dealer.close()
        pull.close()

    def _dispatch(self, reply: dict[str, Any]) -> None:
        rid = reply.get("rid")
        with self._lock:
            sink = self._pending.get(rid)
            if isinstance(sink, Future):
                del self._pending[rid]
        if isinstance(sink, Future):
            sink.set_result(reply)
        elif sink is not None:
            sink.put(reply)


class Submission:
    """The replies of one generate op; aborts the request if abandoned before it finished."""

    def __init__(self, client: RuntimeClient, rid: str, n: int, replies: queue.Queue):
        self.client, self.rid, self.n, self._replies = client, rid, n, replies

    def replies(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        finished = 0
        try:
            while finished < self.n:
                try:
                    reply = self._replies.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"request {self.rid} got no reply within {timeout}s") from None
                _raise_for(reply)
                finished += bool(reply.get("finished"))
                yield reply
        finally:
            self.client._forget(self.rid)
            if finished < self.n:
                self.client.abort(self.rid)

    def finals(self, timeout: float | None = None) -> list[dict[str, Any]]:
        finals = [r for r in self.replies(timeout) if r.get("finished")]
        return sorted(finals, key=lambda r: r.get("index", 0))
