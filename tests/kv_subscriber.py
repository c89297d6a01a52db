"""A KV-event subscriber for the tests, written from vLLM's event schema and independent of
radixrt's code: it decodes batches with msgspec into vLLM's `array_like` tagged structs (as
vLLM's own subscribers do), rebuilds the set of pages a server holds per medium, requests
replays, and computes vLLM's `sha256_cbor` block hashes with cbor2."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import msgspec
import zmq


# ---- vLLM's wire structs (vllm/distributed/kv_events.py, array_like) -------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---- vLLM's block hash (vllm/utils/hashing.py sha256_cbor, kv_cache_utils) --------------------
def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def vllm_block_hashes(
    tokens: list[int], block_size: int, seed: str = "", extra_first: tuple | None = None
) -> list[int]:
    """vLLM's chained hashes of the full blocks of `tokens` (NONE_HASH from PYTHONHASHSEED=seed;
    `extra_first` the first block's extra keys, as vLLM's cache_salt), published as ints."""
    parent = sha256_cbor(seed)
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = sha256_cbor((parent, block, extra_first if i == 0 else None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def held_pages(snapshot: dict, page_size: int, seed: str = "") -> dict[str, set[int]]:
    """The page hashes a `memory_snapshot` says the tree holds, per medium: each node's pages
    hashed from its whole path (its root's salt as the first page's extra key)."""
    nodes = {n["id"]: n for n in snapshot["nodes"]}
    salts = {root: salt for salt, root in snapshot["root_of_salt"].items()}
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for node in nodes.values():
        path, at = [], node
        while at is not None:
            path = at["key"] + path
            parent = at["parent"]
            salt = salts.get(parent)
            at = nodes.get(parent)
        extra = (salt,) if salt else None
        hashes = vllm_block_hashes(path, page_size, seed, extra)[-len(node["key"]) // page_size :]
        if node["slots"]:
            held["GPU"].update(hashes)
        if node["host_slots"]:
            held["CPU"].update(hashes)
    return held


class PageIndex:
    """What an indexer knows from events alone: page hashes per medium, the last sequence number."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.last_seq = -1
        self.gaps = 0  # gaps a subscriber replayed
        self.stored: list[BlockStored] = []

    def apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # a replayed batch already seen live
        self.last_seq = seq
        for event in DECODER.decode(payload).events:
            if isinstance(event, BlockStored):
                self.held[event.medium or "GPU"].update(event.block_hashes)
                self.stored.append(event)
            elif isinstance(event, BlockRemoved):
                self.held[event.medium or "GPU"].difference_update(event.block_hashes)
            else:
                for pages in self.held.values():
                    pages.clear()


class Subscriber:
    """A SUB socket on the publisher's endpoint feeding a `PageIndex`, and a DEALER for replays."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: bytes = b"", **opts: int):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        for name, value in opts.items():
            self.sub.setsockopt(getattr(zmq, name), value)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.index = PageIndex()
        self.topics: set[bytes] = set()

    def drain(self, quiet_ms: int = 300) -> int:
        """Apply every batch that arrives until none has for `quiet_ms`; returns how many. A
        batch after a gap (batches this socket missed) is applied after a replay of the gap,
        as an indexer must."""
        n = 0
        while self.sub.poll(quiet_ms):
            topic, raw_seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(raw_seq, "big")
            if seq > self.index.last_seq + 1 and self.replay_endpoint is not None:
                self.index.gaps += 1
                self.replay(self.index.last_seq + 1)
            self.index.apply(seq, payload)
            n += 1
        return n

    def replay(self, start: int, timeout_ms: int = 5000) -> int:
        """Ask for every buffered batch from `start` on and apply them; returns how many came."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        n = 0
        try:
            while True:
                assert dealer.poll(timeout_ms), "no replay answer"
                _, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return n
                self.index.apply(int.from_bytes(seq, "big"), payload)
                n += 1
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()
