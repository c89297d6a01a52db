"""KV-cache events without a model: the hashes against vLLM's `sha256_cbor` computed with cbor2,
the tree's events rebuilding exactly the pages it holds through random operations, and the
ZeroMQ publisher (vLLM's wire, replay, a subscriber that stops reading) with real sockets."""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_cache.test_radix_cache import Harness, ops

from radixrt.config import HICACHE_WRITE_POLICIES, ServerArgs
from radixrt.mem_cache.kv_events import (
    MEDIUM_DEVICE,
    Adapter,
    BlockRemoved,
    KVEventsConfig,
    KVEventSink,
    ZmqEventPublisher,
    binds,
    external,
)

from helpers import run_script
from kv_subscriber import PageIndex, Subscriber, held_pages, vllm_block_hashes


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", ["", "0", "12345"])
def test_page_hashes_equal_vllms_sha256_cbor(page_size, seed):
    """Token ids of every CBOR width (up to 2^32 and past it), full pages only."""
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 7] * 5
    sink = KVEventSink(page_size, seed=seed)
    mine = [external(d) for d in sink.digests(None, tokens, "")]
    assert mine == vllm_block_hashes(tokens, page_size, seed)
    # chained: the second half hashed under the first half's last page gives the same tail
    half = (len(tokens) // 2) // page_size * page_size
    first = sink.digests(None, tokens[:half], "")
    rest = sink.digests(first[-1], tokens[half:], "") if first else []
    assert [external(d) for d in first + rest] == mine


def test_a_namespace_is_the_first_pages_extra_key():
    tokens = list(range(40))
    sink = KVEventSink(8, seed="")
    salted = [external(d) for d in sink.digests(None, tokens, "0::tenant-a")]
    assert salted == vllm_block_hashes(tokens, 8, "", ("0::tenant-a",))
    other = [external(d) for d in sink.digests(None, tokens, "0::tenant-b")]
    plain = [external(d) for d in sink.digests(None, tokens, "")]
    assert not set(salted) & set(other) and not set(salted) & set(plain)


def _wire_roundtrip(events) -> bytes:
    """A batch as the publisher packs it (sequence numbers aside)."""
    return msgpack.packb([time.time(), [e.wire() for e in events], 0])


class EventHarness(Harness):
    """The radix cache harness with a KV-event sink; every operation ends a batch, which a
    `PageIndex` (vLLM's structs, msgspec) applies."""

    def __init__(self, page_size: int, host: str | None = None):
        super().__init__(page_size, host)
        self.index = PageIndex()
        self.tree.events = KVEventSink(page_size, publish=self._deliver, seed="")

    def _deliver(self, events) -> None:
        self.index.apply(self.index.last_seq + 1, _wire_roundtrip(events))

    def check(self) -> None:
        super().check()
        self.tree.events.end_batch()
        assert self.index.held == held_pages(self.snapshot(), self.page)


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    host=st.sampled_from([None, *HICACHE_WRITE_POLICIES]),
    script=ops,
)
def test_events_rebuild_exactly_the_pages_the_tree_holds(page_size, host, script):
    """Insertions, splits, device and host eviction, backups, load-backs and a flush: after every
    operation the pages rebuilt from the events alone equal those the tree holds, per medium."""
    h = EventHarness(page_size, host)
    run_script(h, script)
    while h.locks:
        h.unlock(0)
    assert h.tree.flush()
    h.check()
    assert h.index.held == {"GPU": set(), "CPU": set()}


def test_salted_and_adapter_pages_carry_their_namespace():
    sink = KVEventSink(2, adapter_of=lambda s: Adapter(7, "sql") if s.startswith("L") else None)
    h = EventHarness(2)
    h.tree.events = sink
    h.tree.insert([1, 2, 3, 4], torch.tensor([2, 3, 4, 5]), salt="L3:sql:ab:0::")
    h.tree.insert([1, 2, 3, 4], torch.tensor([6, 7, 8, 9]), salt="0::x")
    stored = sink.pending
    assert [(e.adapter, e.medium) for e in stored] == [
        (Adapter(7, "sql"), MEDIUM_DEVICE),
        (None, MEDIUM_DEVICE),
    ]
    assert stored[0].block_hashes == vllm_block_hashes([1, 2, 3, 4], 2, "", ("L3:sql:ab:0::",))
    assert stored[1].block_hashes == vllm_block_hashes([1, 2, 3, 4], 2, "", ("0::x",))
    assert stored[0].wire()[5:] == [7, "GPU", "sql"]


# ---- the ZeroMQ publisher ----------------------------------------------------------------------
def _publisher(tmp_path, **overrides) -> ZmqEventPublisher:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/kv",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv@pod-a@tiny",
        **overrides,
    }
    return ZmqEventPublisher(KVEventsConfig.from_json(json.dumps(config)))


def _stored(i: int, n_tokens: int = 8) -> list:
    sink = KVEventSink(4, seed="")
    tokens = list(range(i * 1000, i * 1000 + n_tokens))
    sink.stored(sink.digests(None, tokens, ""), None, tokens, MEDIUM_DEVICE, "")
    return sink.pending


def test_vllm_subscriber_decodes_batches_and_replays_after_a_restart(tmp_path):
    pub = _publisher(tmp_path)
    sub = Subscriber(pub.config.endpoint, pub.config.replay_endpoint)
    try:
        time.sleep(0.2)  # the subscription reaches the publisher
        for i in range(3):
            pub.publish(_stored(i))
        assert sub.drain() == 3 and sub.topics == {b"kv@pod-a@tiny"}
        assert sub.index.last_seq == 2 and sub.index.gaps == 0
        assert sub.index.held["GPU"] == {
            h for i in range(3) for h in vllm_block_hashes(list(range(i * 1000, i * 1000 + 8)), 4)
        }
        first = sub.index.stored[0]
        assert (first.block_size, first.lora_id, first.medium, first.token_ids[:2]) == (
            4,
            None,
            "GPU",
            [0, 1],
        )
        sub.close()  # the indexer restarts; batches go on meanwhile
        pub.publish(_stored(3))
        pub.publish([BlockRemoved([vllm_block_hashes(list(range(8)), 4)[1]], "GPU")])
        late = Subscriber(pub.config.endpoint, pub.config.replay_endpoint)
        late.index = sub.index
        assert late.replay(sub.index.last_seq + 1) == 2
        assert late.index.last_seq == 4
        late.close()
        assert pub.counts.replay_requests == 1 and pub.counts.dropped_batches == 0
    finally:
        pub.close()


def test_a_subscriber_that_stops_reading_never_blocks_publishing(tmp_path):
    """A subscriber that reads nothing while batches pile up loses those past its high-water
    mark, without holding publishing or the other subscribers back; the next batch it reads
    shows it the gap in the sequence numbers, and it gets every batch back by replay."""
    pub = _publisher(tmp_path, hwm=64)
    stuck = Subscriber(pub.config.endpoint, pub.config.replay_endpoint, RCVHWM=1, RCVBUF=4096)
    reader = Subscriber(pub.config.endpoint, pub.config.replay_endpoint)
    try:
        time.sleep(0.2)
        big = _stored(1, n_tokens=4096)  # about 20 kB a batch
        n = 300
        start = time.perf_counter()
        for _ in range(n):
            pub.publish(big)
            reader.drain(quiet_ms=0)
        assert time.perf_counter() - start < 5.0, "publishing waited"
        reader.drain()
        assert reader.index.last_seq == n - 1
        assert stuck.drain() < n, "the stuck subscriber took everything: nothing was tested"
        pub.publish(big)  # the next batch shows the stuck subscriber its gap: it replays it
        stuck.drain()
        assert stuck.index.gaps > 0 and stuck.index.last_seq == n
        assert pub.counts.published_batches == n + 1 and pub.counts.dropped_batches == 0
    finally:
        stuck.close()
        reader.close()
        pub.close()


def test_a_full_queue_drops_and_counts(tmp_path):
    pub = _publisher(tmp_path, max_queue_size=1)
    try:
        for _ in range(2000):
            pub.publish(_stored(1))
        pub.close()
        counts = pub.counts
        assert counts.dropped_batches > 0
        assert counts.published_batches + counts.dropped_batches == 2000
    finally:
        pub.close()


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "'endpont'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"hwm": 0}', "hwm"),
        ('{"buffer_steps": 1.5}', "buffer_steps"),
        ('{"endpoint": "http://x:1"}', "endpoint"),
        ("[1]", "JSON object"),
        ("{enable: true}", "not JSON"),
    ],
)
def test_a_malformed_config_is_refused_by_name(config, named):
    with pytest.raises(ValueError, match="kv_events_config") as info:
        ServerArgs(kv_events_config=config)
    assert named in str(info.value)


def test_endpoints_bind_loopback_and_wildcards_and_connect_elsewhere():
    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"
    assert all(
        binds(e) for e in ("tcp://127.0.0.1:1", "tcp://*:1", "ipc:///tmp/x", "tcp://[::1]:1")
    )
    assert not binds("tcp://indexer.svc:5557")
    assert not KVEventsConfig().enabled
    assert KVEventsConfig(enable_kv_cache_events=True).enabled
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled


def test_dp_fleets_are_refused_with_one_endpoint():
    with pytest.raises(ValueError, match="dp_size"):
        ServerArgs(dp_size=2, kv_events_config='{"enable_kv_cache_events": true}')


def test_an_endpoint_in_use_is_refused_at_start():
    first = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0")
    )
    port = first._pub.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
    try:
        with pytest.raises(ValueError, match="kv_events_config: cannot open"):
            ZmqEventPublisher(
                KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
            )
    finally:
        first.close()


def test_malformed_replay_requests_warn_once_and_are_ignored(tmp_path, caplog):
    """A flood of malformed replay requests logs one warning (with a count later), not one each;
    the publisher goes on answering well-formed ones."""
    pub = _publisher(tmp_path)
    ctx = zmq.Context.instance()
    try:
        pub.publish(_stored(0))
        with caplog.at_level("WARNING", logger="radixrt.mem_cache.kv_events"):
            for _ in range(50):
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 1000)
                dealer.connect(pub.config.replay_endpoint)
                dealer.send_multipart([b"", b"short"])
                dealer.close()
            sub = Subscriber(pub.config.endpoint, pub.config.replay_endpoint)
            assert sub.replay(0) == 1  # answered after every malformed one was read
            sub.close()
        warned = [r for r in caplog.records if "malformed replay request" in r.getMessage()]
        assert len(warned) == 1
    finally:
        pub.close()
