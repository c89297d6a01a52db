"""The router's link to one worker: a DEALER socket, a monitor of it, liveness, load, and the
approximate prefix tree of what was sent there."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from radixrt.protocol import decode_map
from radixrt.server.router.prefix_tree import ApproxPrefixTree

logger = logging.getLogger(__name__)

# the tree's bound until the worker's stats say how large its pool (and host tier) is
DEFAULT_CAPACITY = 1 << 16


class WorkerLink:
    """One worker as the router sees it.

    `alive` turns true on the worker's first answer and false when its connection drops (the
    socket monitor says so at once when the process dies), when it falls silent, or when it
    answers with a new `server_id` (it restarted: what it held is gone). With `IMMEDIATE` set, a
    frame is queued only on a live connection, so nothing sent to a dead worker is delivered to
    its successor later.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        index: int,
        url: str,
        api_key: str | None = None,
        curve_server_key: str | None = None,
    ):
        self.index, self.url, self.api_key = index, url, api_key
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        if curve_server_key:
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
            self.sock.curve_serverkey = curve_server_key.encode()
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(url)
        self.alive = False
        self.server_id: str | None = None
        self.last_heard = 0.0
        self.load = 0  # sequences (samples) in flight there
        self.tree = ApproxPrefixTree(DEFAULT_CAPACITY)
        self.stats: dict[str, Any] = {}  # its last stats reply

    def send(self, msg: dict[str, Any]) -> bool:
        """Queue one map for the worker; False when there is no live connection to queue it on.
        A map that carries its own `api_key` (a client's, forwarded) keeps it."""
        if self.api_key is not None:
            msg = {"api_key": self.api_key, **msg}
        try:
            self.sock.send(msgpack.packb(msg, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv_all(self) -> list[dict[str, Any]]:
        """Every reply waiting on the socket (frames that are not maps are logged and dropped)."""
        replies = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return replies
            self.last_heard = time.monotonic()
            reply, error = decode_map(frame)
            if error is not None:
                logger.warning("worker %s: %s", self.url, error["error"]["message"])
                continue
            replies.append(reply)

    def disconnected(self) -> bool:
        """Whether the monitor reported the connection dropped since the last call."""
        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            dropped |= event["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "alive": self.alive, "load": self.load, **self.stats}

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
