"""The radix cache on its own, with and without a host tier, driven by random operation
sequences (invariants 2 and 3, and where every node's KV lives)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.config import HICACHE_WRITE_POLICIES
from radixrt.mem_cache.host_pool import HostKVPool
from radixrt.mem_cache.memory_pool import PageAllocator, TokenToKVPool
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import pool_snapshot

from helpers import run_script, scripts
from ownership import assert_slot_ownership

TOTAL = 256
HOST_TOTAL = 96  # smaller than the device pool: host reclaim runs often


class Harness:
    """A tree over a real allocator and a real one-number-per-token KV pool (and, with `host`, a
    real host pool under it): every written slot holds a number standing for the token prefix
    whose KV it would be, so copies between the pools are checked by content."""

    def __init__(self, page_size: int, host: str | None = None):
        self.page = page_size
        self.alloc = PageAllocator(TOTAL, page_size, torch.device("cpu"))
        self.pool = TokenToKVPool(self.alloc.num_slots, 1, 1, 1, torch.float32, torch.device("cpu"))
        self.host = HostKVPool(self.pool, HOST_TOTAL, page_size) if host else None
        self.tree = RadixCache(
            page_size,
            self.alloc.free,
            host=self.host,
            write_policy=host or HICACHE_WRITE_POLICIES[0],
        )
        self.ids: dict[tuple[int, ...], float] = {}  # prefix -> the number its KV is
        self.locks: list = []

    def _id(self, prefix: list[int]) -> float:
        return self.ids.setdefault(tuple(prefix), float(len(self.ids) + 1))

    def insert(self, key: list[int]) -> None:
        """What a request does: match, load the host part back, compute the rest, insert."""
        key = key[: len(key) - len(key) % self.page]
        match = self.tree.match_prefix(key)
        m, on_host = len(match.slots), len(match.host_slots)
        need = len(key) - m
        self.tree.inc_lock_ref(match.end_node)  # what we matched must survive the eviction below
        if need and self.alloc.available() < need:
            self.tree.evict(need - self.alloc.available())
        new = self.alloc.alloc_extend(0, 0, need) if need else torch.empty(0, dtype=torch.int64)
        if new is None:
            self.tree.dec_lock_ref(match.end_node)
            return
        if on_host:
            self.tree.load_back(match.host_node, new[:on_host])
        for i, slot in enumerate(new[on_host:].tolist()):
            self.pool.k_buffers[0][slot] = self._id(key[: m + on_host + i + 1])
        self.tree.dec_lock_ref(match.end_node)
        already = self.tree.insert(key, torch.cat([match.slots, new]))
        assert already == m + on_host

    def match(self, key: list[int]) -> None:
        match = self.tree.match_prefix(key)
        assert match.length % self.page == 0 and match.length <= len(key)
        device = self.pool.k_buffers[0][match.slots].flatten().tolist()
        host = (
            [] if self.host is None else self.host.k_buffers[0][match.host_slots].flatten().tolist()
        )
        for i, value in enumerate(device + host):
            assert value == self._id(key[: i + 1]), "a matched slot holds another prefix's KV"

    def lock(self, key: list[int]) -> None:
        node = self.tree.match_prefix(key).node
        self.tree.inc_lock_ref(node)
        self.locks.append((key[: self._depth(node)], node))

    def unlock(self, index: int) -> None:
        if self.locks:
            _, node = self.locks.pop(index % len(self.locks))
            self.tree.dec_lock_ref(node)

    def evict(self, n: int) -> None:
        before = {node: node.last_access for node in self._device_nodes()}
        self.tree.evict(n)
        after = self._device_nodes()
        gone = [node for node in before if node not in after]
        for node in gone:
            assert node.lock_ref == 0
        survivors = [
            node
            for node in after
            if not any(c.on_device for c in node.children.values()) and node.lock_ref == 0
        ]
        if gone and survivors:
            assert max(before[g] for g in gone) <= min(s.last_access for s in survivors), "not LRU"
        for key, _ in self.locks:  # locked prefixes survive eviction
            assert len(self.tree.match_prefix(key).slots) == len(key)

    def evict_host(self, n: int) -> None:
        if self.host is not None:
            self.tree.evict_host(n)

    def _device_nodes(self) -> set:
        return {n for n in self.tree.all_nodes() if n is not self.tree.root and n.on_device}

    def _depth(self, node) -> int:
        depth = 0
        while node is not self.tree.root:
            depth += len(node.key)
            node = node.parent
        return depth

    def snapshot(self) -> dict:
        """The pool and tree as `memory_snapshot` data (no requests; held locks act as pins)."""
        return {
            **pool_snapshot(self.alloc, self.tree),
            "requests": [],
            "pinned_nodes": [node.id for _, node in self.locks],
            "rows": 0,
            "free_rows": 0,
            "running_rows": [],
        }

    def check(self) -> None:
        self.tree.check()
        assert_slot_ownership(self.snapshot())
        nodes = [n for n in self.tree.all_nodes() if n is not self.tree.root]
        held = sum(n.device_len() for n in nodes)
        assert held == self.tree.evictable_size + self.tree.protected_size
        assert self.alloc.available() + held == self.alloc.total_tokens, "slots leaked"
        if self.host is not None:
            on_host = sum(len(n.host_value) for n in nodes if n.on_host)
            assert self.host.available() + on_host == self.host.total_tokens, "host slots leaked"


keys = st.lists(st.integers(0, 3), min_size=1, max_size=24)
ops = scripts(
    [
        ("insert", keys),
        ("match", keys),
        ("lock", keys),
        ("unlock", st.integers(0, 100)),
        ("evict", st.integers(1, 64)),
        ("evict_host", st.integers(1, 64)),
    ],
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    host=st.sampled_from([None, *HICACHE_WRITE_POLICIES]),
    script=ops,
)
def test_random_operations_keep_invariants(page_size, host, script):
    """Both pools, every write policy: ownership, locations, sizes and KV contents hold after
    every operation, and a flush frees both pools."""
    h = Harness(page_size, host)
    run_script(h, script)
    while h.locks:
        h.unlock(0)
    assert h.tree.protected_size == 0
    assert h.tree.flush()
    h.check()
    assert h.alloc.available() == h.alloc.total_tokens
    assert h.host is None or h.host.available() == h.host.total_tokens


def test_split_keeps_locks_and_values():
    h = Harness(1)
    h.insert([1, 2, 3, 4])
    h.lock([1, 2, 3, 4])
    h.insert([1, 2, 9])  # splits the locked edge after [1, 2]
    h.check()
    assert h.tree.protected_size == 4 and h.tree.evictable_size == 1
    h.evict(100)
    h.check()
    h.match([1, 2, 3, 4])
    assert len(h.tree.match_prefix([1, 2, 9]).slots) == 2


def test_eviction_is_least_recently_used_first():
    h = Harness(1)
    h.insert([1, 1])
    h.insert([2, 2])
    h.insert([3, 3])
    h.match([1, 1])  # now [2, 2] is the oldest
    h.evict(2)
    assert len(h.tree.match_prefix([2, 2]).slots) == 0
    assert (
        len(h.tree.match_prefix([1, 1]).slots) == 2 and len(h.tree.match_prefix([3, 3]).slots) == 2
    )


def _location(h: Harness, key: list[int]) -> str:
    match = h.tree.match_prefix(key)
    assert match.length == len(key)
    node = match.end_node
    return {(True, False): "device", (True, True): "both", (False, True): "host"}[
        (node.on_device, node.on_host)
    ]


def test_write_back_keeps_an_evicted_prefix_on_the_host_and_loads_it_back():
    h = Harness(2, "write_back")
    h.insert([1, 2, 3, 4])
    h.insert([5, 6])
    assert _location(h, [1, 2, 3, 4]) == "device"
    h.match([5, 6])  # [1, 2, 3, 4] is now the older
    h.evict(4)
    assert _location(h, [1, 2, 3, 4]) == "host" and _location(h, [5, 6]) == "device"
    h.check()
    h.match([1, 2, 3, 4])  # the host copy holds the same KV
    before = h.tree.loaded_tokens
    h.insert([1, 2, 3, 4, 7, 8])  # loads [1, 2, 3, 4] back, computes [7, 8]
    assert h.tree.loaded_tokens - before == 4
    assert _location(h, [1, 2, 3, 4]) == "both"
    h.match([1, 2, 3, 4, 7, 8])
    h.check()


def test_write_policies_decide_when_a_node_is_copied():
    for policy, after_insert, after_second_use in [
        ("write_through", "both", "both"),
        ("write_through_selective", "device", "both"),
        ("write_back", "device", "device"),
    ]:
        h = Harness(1, policy)
        h.insert([1, 2, 3])
        assert _location(h, [1, 2, 3]) == after_insert, policy
        h.tree.record_hit(h.tree.match_prefix([1, 2, 3]).node)
        assert _location(h, [1, 2, 3]) == after_second_use, policy
        h.check()


def test_a_full_host_falls_back_to_dropping_prefixes():
    """Without host room an evicted, never reused prefix is gone (it will be recomputed); the
    host reclaims its least recently used host-only leaves for newer ones."""
    h = Harness(1, "write_back")
    for first in range(HOST_TOTAL // 8 + 2):
        h.insert([first] * 8)
        h.evict(TOTAL)  # everything goes to the host, oldest reclaimed when it is full
        h.check()
    assert h.host.available() < 8
    assert h.tree.match_prefix([0] * 8).length == 0  # the oldest was reclaimed
    assert _location(h, [HOST_TOTAL // 8 + 1] * 8) == "host"


def _shape(tree: RadixCache) -> list[tuple]:
    return sorted((n.id, tuple(n.key), n.last_access) for n in tree.all_nodes())


def test_a_peek_measures_what_a_match_would_and_changes_nothing():
    """`peek_prefix` (for ordering) finds the length `match_prefix` finds, device and host parts
    together, without splitting a node or touching an LRU time."""
    h = Harness(2, host="write_back")
    h.insert([1, 2, 3, 4, 5, 6, 7, 8])
    h.insert([1, 2, 3, 4, 9, 9])
    h.insert([5, 5, 5, 5])
    h.evict(4)  # [5, 5, 5, 5] and a leaf move to the host (write_back)
    keys = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 7, 7], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 1], [8, 8]]
    before = _shape(h.tree)
    peeks = [h.tree.peek_prefix(k) for k in keys]
    assert _shape(h.tree) == before
    assert peeks[1].into == 2 and len(peeks[1].node.key) == 4, "ends part way into [1, 2, 3, 4]"
    assert [p.length for p in peeks] == [h.tree.match_prefix(k).length for k in keys]
    assert [p.length for p in peeks] == [6, 2, 6, 4, 0]
    assert _shape(h.tree) != before, "(matching splits and touches)"
    h.check()
