"""The router's link to one worker: a DEALER socket, a monitor of it, liveness, load, the
approximate prefix tree of what was sent there, and the check of what comes back."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from radixrt.protocol import ErrorCode, RequestError, decode_map
from radixrt.server.exposure import CLOSE_LINGER_MS
from radixrt.server.router.prefix_tree import ApproxPrefixTree

logger = logging.getLogger(__name__)

# the tree's bound until the worker's stats say how large its pool (and host tier) is
DEFAULT_CAPACITY = 1 << 16
MAX_COMPLAINTS = 64  # kinds of malformed reply remembered per worker, so each is logged once


def reply_problem(reply: dict[str, Any], result_map: bool = False) -> str | None:
    """What is wrong with the fields of a worker's reply that the router reads (None: nothing):
    `error` a map with a string `code` and `message`, `finished` a bool, `output_ids` a list of
    ints, and, with `result_map`, a map `result` unless it is an error. A worker is trusted no
    more than a client: a reply that fails this must cost at most the request it names."""
    error = reply.get("error")
    if error is not None:
        if not isinstance(error, dict) or not all(
            isinstance(error.get(k), str) for k in ("code", "message")
        ):
            return "its error is not a map with a string code and message"
        return None
    if not isinstance(reply.get("finished", False), bool):
        return "its finished is not a bool"
    ids = reply.get("output_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        return "its output_ids is not a list of ints"
    if result_map and not isinstance(reply.get("result"), dict):
        return "its result is not a map"
    return None


class WorkerLink:
    """One worker as the router sees it.

    `alive` turns true on the worker's first answer and false when its connection drops (the
    socket monitor says so at once when the process dies), when it falls silent, or when it
    answers with a new `server_id` (it restarted: what it held is gone).

    Frames are queued only on a connection whose handshake completed (`connected`). A dropped
    connection's socket is read to its end and then replaced (`reopen`): what was queued for
    the dead peer dies with the old socket, so nothing sent to a dead worker reaches its
    successor. (ZMQ's `IMMEDIATE` would do the latter, but it also discards replies that had
    arrived and were not read yet: a drained worker's last chunks, sent just before it exits.)
    Closing waits up to `CLOSE_LINGER_MS` for queued frames (the aborts a stopping router sends).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        index: int,
        url: str,
        api_key: str | None = None,
        curve_server_key: str | None = None,
        max_frame_bytes: int | None = None,
    ):
        self.ctx, self.index, self.url, self.api_key = ctx, index, url, api_key
        self.max_frame_bytes = max_frame_bytes  # the workers' --max-frame-bytes (the router's)
        self.curve_server_key = curve_server_key
        self._open()
        self.alive = False
        self.server_id: str | None = None
        self.last_heard = 0.0
        self.load = 0  # sequences (samples) in flight there
        self.tree = ApproxPrefixTree(DEFAULT_CAPACITY)
        self.stats: dict[str, Any] = {}  # its last stats reply
        self._complaints: set[str] = set()  # what was logged about its replies already

    def _open(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        if self.curve_server_key:
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
            self.sock.curve_serverkey = self.curve_server_key.encode()
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self.connected = False
        self.sock.connect(self.url)

    def send(self, msg: dict[str, Any]) -> bool:
        """Queue one map for the worker; False when there is no live connection to queue it on.
        A map that carries its own `api_key` (a client's, forwarded) keeps it. A map that packs
        past the worker's frame limit is a RequestError (`invalid_request`) and is not sent: the
        worker would drop the connection, and with it every request in flight there."""
        if not self.connected:
            return False
        if self.api_key is not None:
            msg = {"api_key": self.api_key, **msg}
        frame = msgpack.packb(msg, use_bin_type=True)
        if self.max_frame_bytes is not None and len(frame) > self.max_frame_bytes:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"the request packs to {len(frame)} bytes for a worker; a worker takes at most "
                f"{self.max_frame_bytes} bytes in one frame (--max-frame-bytes)",
            )
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv_all(self) -> list[dict[str, Any]]:
        """Every reply waiting on the socket (frames that are not maps are logged and dropped)."""
        replies: list[dict[str, Any]] = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return replies
            self.last_heard = time.monotonic()
            reply, error = decode_map(frame)
            if error is not None:
                self.complain(f"dropped a reply: {error['error']['message']}")
                continue
            assert reply is not None  # decode_map gives one of the two
            replies.append(reply)

    def complain(self, what: str) -> None:
        """Log `what` is wrong with this worker's replies, once (until `MAX_COMPLAINTS` kinds
        were logged, when the record starts afresh): a worker that answers every ping wrongly
        does not fill the log."""
        if what not in self._complaints:
            if len(self._complaints) >= MAX_COMPLAINTS:
                self._complaints.clear()
            self._complaints.add(what)
            logger.warning("worker %s: %s", self.url, what)

    def watch(self) -> bool:
        """Read the monitor's events: a completed handshake makes the link `connected`; True
        when the connection dropped since the last call (the caller reads what the socket
        still holds, then calls `reopen`)."""
        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            dropped |= event == zmq.EVENT_DISCONNECTED
            self.connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return dropped

    def reopen(self) -> None:
        """Replace the socket of a dropped connection, discarding what was queued for the dead
        peer; the new one connects to the same URL (a successor is found when it comes up)."""
        self.close(linger=0)
        self._open()

    def describe(self) -> dict[str, Any]:
        return {
            **self.stats,
            "url": self.url,
            "alive": self.alive,
            "load": self.load,
            "router_namespaces": len(self.tree.roots),
        }

    def close(self, linger: int | None = None) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close(linger=linger)
