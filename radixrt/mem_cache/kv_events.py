"""KV-cache events: every page the radix tree stores, evicts or clears, published over ZeroMQ
in vLLM's event schema, so an external indexer (llm-d's KV-cache manager, a Gateway API
endpoint picker) knows which pages each server holds.

Wire (vLLM's `vllm/distributed/kv_events.py`, its msgspec `array_like` tagged structs, as
llm-d's kv-cache-manager decodes them): each batch is a PUB message of three frames,
`(topic, seq as 8 bytes big-endian, payload)`, the payload one msgpack array
`[ts, [event, ...], data_parallel_rank]` where an event is
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]`, `["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`. A batch holds
what one scheduler step (or an idle turn, or a flush) changed. Sequence numbers start at 0 and
grow by one per batch, counted when the batch is queued, so a batch dropped anywhere leaves a
gap a subscriber sees. With a `replay_endpoint`, a ROUTER socket answers a request
`[b"", start_seq as 8 bytes big-endian]` (a REQ or DEALER client) with every buffered batch from
`start_seq` on as `[b"", seq, payload]` frames, then `[b"", -1 as 8 bytes signed, b""]`: vLLM's
replay protocol, so a restarted indexer catches up.

Block hashes (`page_digests`): one per full page, `block_size` = the page size, chained:
`digest_i = sha256(CBOR([digest_{i-1}, [token ids of page i], extra]))` in canonical CBOR (the
parent a 32-byte string, the tokens unsigned integers), `digest_{-1}` = `sha256(CBOR(seed))`
with the seed `$PYTHONHASHSEED` ("" when unset), and `extra` null except on the first page of
a namespace other than the shared default, where it is `[namespace]` (the tree's salt: tenant,
`cache_salt`, adapter), so one tenant's prefix never matches another's. Published as the low 64
bits of the digest, big-endian (an unsigned integer). That is vLLM's `sha256_cbor` block hash
with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (its default) under the same `PYTHONHASHSEED`:
for the same token ids and block size, a default-namespace page has vLLM's hash. vLLM's own
salts put the raw `cache_salt` there, so salted pages hash differently from vLLM's (and from
each other's).

Medium: "GPU" for the KV pool the model runs on (on a CPU-only server too: it is the first tier,
where llm-d's default "gpu" tier points), "CPU" for the host tier. A page held in both is stored
once per medium and removed per medium; `AllBlocksCleared` empties every medium.

Publishing never slows serving: the tree's hook appends to a list; each step's batch goes to a
bounded queue (`max_queue_size` batches) without waiting, or is dropped and counted
(`dropped_batches`, in `/metrics`) when the queue is full; a thread encodes and sends it and keeps
the last `buffer_steps` batches for replay. A subscriber that reads too slowly loses batches past
its high-water mark (`hwm`) on its own connection, as ZeroMQ's PUB does, without holding back the
others: it sees the gap in the sequence numbers and replays it. Nothing read from a socket is
ever unpickled: a replay request is two frames of bytes, and a longer frame drops its sender
(`REPLAY_MAX_FRAME_BYTES`, ZeroMQ's MAXMSGSIZE; subscriptions are bounded the same way); a
malformed request's warning is logged at most once per `radixrt.logs.LOG_EVERY_S` (10 s).

Tenants: a page under a tenant's key or a `cache_salt` is published with its block hashes and no
token ids (the ids would spell the tenant's prompt), unless the config's
`publish_tenant_token_ids` is true. Binding beyond loopback needs the server's keys or the
config's `allow_non_loopback` (`server/exposure.py`): these sockets check no key.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from radixrt.config import WILDCARD_HOSTS, KVEventsConfig, tcp_host
from radixrt.logs import LogThrottle

logger = logging.getLogger(__name__)

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05  # the publisher thread's wait for a batch or a replay request
CBOR_NULL = b"\xf6"
BIND_HOSTS = (*WILDCARD_HOSTS, "127.0.0.1", "localhost", "[::1]", "::1")
# what the replay socket takes: a request is an empty frame and 8 bytes; a longer frame drops
# the sender's connection before ZeroMQ allocates it (ZMQ_MAXMSGSIZE), and a peer may queue
# only a few requests
REPLAY_MAX_FRAME_BYTES = 64
REPLAY_RCVHWM = 16
# what the PUB socket takes from a subscriber: its subscriptions (topic prefixes)
SUBSCRIPTION_MAX_BYTES = 4096


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (else it connects to it): see `KVEventsConfig`."""
    host = tcp_host(endpoint)
    return host is None or host in BIND_HOSTS


# ---- block hashes ---------------------------------------------------------------------------
def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR item head: the major type and its argument in the fewest bytes."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError("a CBOR argument takes at most 64 bits")


@functools.lru_cache(maxsize=1 << 18)  # a vocabulary's worth: token ids repeat
def _cbor_uint(n: int) -> bytes:
    return _cbor_head(0, n)


def _cbor_text(text: str) -> bytes:
    raw = text.encode()
    return _cbor_head(3, len(raw)) + raw


def seed_digest(seed: str) -> bytes:
    """The parent of a namespace's first page (vLLM's NONE_HASH under PYTHONHASHSEED=seed)."""
    return hashlib.sha256(_cbor_text(seed)).digest()


def page_digests(
    parent: bytes, tokens: Sequence[int], page_size: int, namespace: str | None
) -> list[bytes]:
    """The chained digests of the full pages of `tokens` following `parent`'s page; the first
    one carries `namespace` as its extra key (None: not a namespace's first page, or the
    shared default namespace). Each hashes the CBOR of vLLM's `(parent, tuple(token_ids),
    extra_keys)`: a 3-array of the 32-byte parent, the tokens' array and the extra keys."""
    head, page_head = _cbor_head(4, 3) + _cbor_head(2, len(parent)), _cbor_head(4, page_size)
    extra = CBOR_NULL if namespace is None else _cbor_head(4, 1) + _cbor_text(namespace)
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        body = b"".join(map(_cbor_uint, tokens[start : start + page_size]))
        parent = hashlib.sha256(head + parent + page_head + body + extra).digest()
        extra = CBOR_NULL
        out.append(parent)
    return out


def external(digest: bytes) -> int:
    """A digest as published: its low 64 bits, big-endian (vLLM's int block hashes)."""
    return int.from_bytes(digest[-8:], "big")


# ---- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter a namespace's pages were computed under."""

    lora_id: int
    lora_name: str


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    adapter: Adapter | None = None

    def wire(self) -> list[Any]:
        lora = self.adapter
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            None if lora is None else lora.lora_id,
            self.medium,
            None if lora is None else lora.lora_name,
        ]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventCounts:
    """What the publisher did since start (read by `stats`, rendered in `/metrics`)."""

    published_batches: int = 0  # sent on the PUB socket (by the publisher thread)
    dropped_batches: int = 0  # lost to a full queue (counted by the serving thread)
    replay_requests: int = 0


class KVEventSink:
    """What the radix tree calls as pages come and go: it hashes pages (`digests`) and records
    events; `end_batch` hands what was recorded to the publisher as one batch. Without a
    publisher (`publish` None) it still records, so the tree's hook is testable on its own."""

    def __init__(
        self,
        page_size: int,
        adapter_of: Callable[[str], Adapter | None] = lambda salt: None,
        publish: Callable[[list[KVEvent]], None] | None = None,
        seed: str | None = None,
        private: Callable[[str], bool] = lambda salt: False,
    ):
        """`private(salt)`: whether a namespace's token ids stay unpublished (its pages go out
        with their block hashes only): a tenant's or a `cache_salt`'s prompts must not be
        readable by whoever subscribes."""
        self.page_size = page_size
        self.adapter_of = adapter_of
        self.private = private
        self.publish = publish
        self.root_digest = seed_digest(
            os.environ.get("PYTHONHASHSEED", "") if seed is None else seed
        )
        self.pending: list[KVEvent] = []

    def digests(self, parent: bytes | None, tokens: Sequence[int], salt: str) -> list[bytes]:
        """The page digests of `tokens` under a node whose last page digest is `parent` (None:
        under the root of namespace `salt`)."""
        if parent is None:
            return page_digests(self.root_digest, tokens, self.page_size, salt or None)
        return page_digests(parent, tokens, self.page_size, None)

    def stored(
        self, digests: list[bytes], parent: bytes | None, tokens: list[int], medium: str, salt: str
    ) -> None:
        self.pending.append(
            BlockStored(
                [external(d) for d in digests],
                None if parent is None else external(parent),
                [] if self.private(salt) else tokens,
                self.page_size,
                medium,
                self.adapter_of(salt),
            )
        )

    def removed(self, digests: list[bytes], medium: str) -> None:
        self.pending.append(BlockRemoved([external(d) for d in digests], medium))

    def cleared(self) -> None:
        self.pending = [AllBlocksCleared()]  # what came before is cleared too

    def end_batch(self) -> None:
        """Publish what was recorded since the last batch (nothing when nothing changed)."""
        if self.pending and self.publish is not None:
            self.publish(self.pending)
        self.pending = []


# ---- the ZeroMQ publisher -------------------------------------------------------------------
@dataclass
class _Batch:
    seq: int
    ts: float
    events: list[KVEvent]


@dataclass
class ZmqEventPublisher:
    """PUB socket (and optional replay ROUTER) served by one thread; see the module docstring.
    `publish` never blocks. Sockets are made, bound or connected in the caller's thread, so
    a busy port fails at start; the thread owns them after."""

    config: KVEventsConfig
    data_parallel_rank: int = 0
    counts: EventCounts = field(default_factory=EventCounts)

    def __post_init__(self) -> None:
        cfg = self.config
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._next_seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES + len(cfg.topic.encode()))
        self._replay: zmq.Socket[bytes] | None = None
        self._warnings = LogThrottle(logger)
        try:
            (self._pub.bind if binds(cfg.endpoint) else self._pub.connect)(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME_BYTES)
                self._replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {cfg.endpoint}: {e}") from None
        self._topic = cfg.topic.encode()
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch without waiting; a full queue drops it (counted)."""
        batch = _Batch(self._next_seq, time.time(), events)
        self._next_seq += 1
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.counts.dropped_batches += 1

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._running:
            self._running = False
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _serve(self) -> None:
        packer = msgpack.Packer()
        while True:
            if self._replay is not None and self._replay.poll(0):
                # a replay includes every batch published before the request came
                if not self._send_queued(packer, 0):
                    return
                self._answer_replay()
            if not self._send_queued(packer, POLL_S):
                return

    def _send_queued(self, packer: msgpack.Packer, wait: float) -> bool:
        """Send the batches queued now, waiting up to `wait` seconds for the first; False once
        `close` asked the thread to end."""
        for _ in range(max(1, self._queue.qsize())):
            try:
                batch = self._queue.get(timeout=wait)
            except queue.Empty:
                return True
            if batch is None:
                return False
            payload = packer.pack(
                [batch.ts, [e.wire() for e in batch.events], self.data_parallel_rank]
            )
            self._buffer.append((batch.seq, payload))
            # never blocks: a subscriber past its high-water mark misses this one (and replays it)
            self._pub.send_multipart([self._topic, batch.seq.to_bytes(8, "big"), payload])
            self.counts.published_batches += 1
        return True

    def _answer_replay(self) -> None:
        """Answer one replay request (vLLM's protocol); a malformed one is ignored."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self._warnings.note("kv events: ignored a malformed replay request")
            return
        self.counts.replay_requests += 1
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])
