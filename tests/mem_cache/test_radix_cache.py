"""The radix cache on its own, driven by random operation sequences (invariants 2 and 3)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.mem_cache.memory_pool import PageAllocator
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import pool_snapshot

from helpers import run_script, scripts
from ownership import assert_slot_ownership

TOTAL = 256


class Harness:
    """A tree over a real allocator; every slot records which token prefix its KV would hold."""

    def __init__(self, page_size: int):
        self.page = page_size
        self.alloc = PageAllocator(TOTAL, page_size, torch.device("cpu"))
        self.tree = RadixCache(page_size, self.alloc.free)
        self.content: dict[int, tuple[int, ...]] = {}
        self.locks: list = []

    def insert(self, key: list[int]) -> None:
        key = key[: len(key) - len(key) % self.page]
        cached, node = self.tree.match_prefix(key)
        m = len(cached)
        need = len(key) - m
        self.tree.inc_lock_ref(node)  # what we matched must survive the eviction below
        if need and self.alloc.available() < need:
            self.tree.evict(need - self.alloc.available())
        new = self.alloc.alloc_extend(0, 0, need) if need else torch.empty(0, dtype=torch.int64)
        self.tree.dec_lock_ref(node)
        if new is None:
            return
        for i, slot in enumerate(new.tolist()):
            self.content[slot] = tuple(key[: m + i + 1])
        already = self.tree.insert(key, torch.cat([cached, new]))
        assert already == m

    def match(self, key: list[int]) -> None:
        slots, node = self.tree.match_prefix(key)
        assert len(slots) % self.page == 0 and len(slots) <= len(key)
        for i, slot in enumerate(slots.tolist()):
            assert self.content[slot] == tuple(key[: i + 1]), (
                "a matched slot holds another prefix's KV"
            )

    def lock(self, key: list[int]) -> None:
        _, node = self.tree.match_prefix(key)
        self.tree.inc_lock_ref(node)
        self.locks.append((key[: self._depth(node)], node))

    def unlock(self, index: int) -> None:
        if self.locks:
            _, node = self.locks.pop(index % len(self.locks))
            self.tree.dec_lock_ref(node)

    def evict(self, n: int) -> None:
        before = {node: node.last_access for node in self.tree.all_nodes()}
        self.tree.evict(n)
        after = set(self.tree.all_nodes())
        gone = [node for node in before if node not in after]
        for node in gone:
            assert node.lock_ref == 0
        survivors = [
            node
            for node in after
            if node.is_leaf and node.lock_ref == 0 and node is not self.tree.root
        ]
        if gone and survivors:
            assert max(before[g] for g in gone) <= min(s.last_access for s in survivors), "not LRU"
        for key, _ in self.locks:  # locked prefixes survive eviction
            assert len(self.tree.match_prefix(key)[0]) == len(key)

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
        held = sum(len(n.value) for n in self.tree.all_nodes())
        assert held == self.tree.evictable_size + self.tree.protected_size
        assert self.alloc.available() + held == self.alloc.total_tokens, "slots leaked"


keys = st.lists(st.integers(0, 3), min_size=1, max_size=24)
ops = scripts(
    [
        ("insert", keys),
        ("match", keys),
        ("lock", keys),
        ("unlock", st.integers(0, 100)),
        ("evict", st.integers(1, 64)),
    ],
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), script=ops)
def test_random_operations_keep_invariants(page_size, script):
    h = Harness(page_size)
    run_script(h, script)
    while h.locks:
        h.unlock(0)
    assert h.tree.protected_size == 0
    assert h.tree.flush()
    h.check()
    assert h.alloc.available() == h.alloc.total_tokens


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
    assert len(h.tree.match_prefix([1, 2, 9])[0]) == 2


def test_eviction_is_least_recently_used_first():
    h = Harness(1)
    h.insert([1, 1])
    h.insert([2, 2])
    h.insert([3, 3])
    h.match([1, 1])  # now [2, 2] is the oldest
    h.evict(2)
    assert len(h.tree.match_prefix([2, 2])[0]) == 0
    assert len(h.tree.match_prefix([1, 1])[0]) == 2 and len(h.tree.match_prefix([3, 3])[0]) == 2
