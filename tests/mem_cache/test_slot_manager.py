"""The KV slot manager without a model: a real pool, a real tree and token ids, driven by random
operation sequences; slot ownership and KV contents are checked after every operation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import KVSlotManager

from helpers import run_script, scripts
from ownership import assert_all_free, assert_slot_ownership

TOTAL_TOKENS = 96
ROWS = 6
CONTEXT = 64
CHUNK = 8


@dataclass(eq=False)
class Holder:
    """A request as the manager sees it: token ids and its memory state."""

    all_ids: list[int]
    name: str
    row: int | None = None
    kv_len: int = 0
    tree_len: int = 0
    last_node: object = None
    pins: list[str] = field(default_factory=list)


class Harness:
    """Runs requests through admit / extend / compute / cache / release / retract like the
    scheduler does, and records which token prefix each written slot's KV stands for."""

    def __init__(self, page_size: int):
        allocator = PageAllocator(TOTAL_TOKENS, page_size, torch.device("cpu"))
        tree = RadixCache(page_size, allocator.free)
        self.kv = KVSlotManager(allocator, ReqToTokenPool(ROWS, CONTEXT, torch.device("cpu")), tree)
        self.running: list[Holder] = []
        self.content: dict[
            int, tuple[int, ...]
        ] = {}  # slot -> the prefix whose last token's KV it holds
        self.pins: list[str] = []
        self.count = 0

    # ---- operations ----------------------------------------------------------------------------
    def admit(self, tokens: list[int]) -> None:
        holder = Holder(list(tokens), f"r{self.count}")
        self.count += 1
        match = self.kv.match_prefix(holder.all_ids[:-1])  # at least one token is computed
        self.kv.lock(match.node)
        n = min(len(tokens) - len(match.slots), CHUNK)
        if self.kv.admit(holder, match, n):
            self.running.append(holder)
            self._compute(holder, n)
        else:
            assert holder.row is None and holder.last_node is None, (
                "a failed admission kept something"
            )

    def step(self, index: int) -> None:
        """The next chunk of a prefilling holder, or one decoded token."""
        if not self.running:
            return
        holder = self.running[index % len(self.running)]
        if holder.kv_len == len(holder.all_ids):
            if len(holder.all_ids) >= CONTEXT:
                return self.finish(index)
            holder.all_ids.append(len(holder.all_ids) % 5)  # the "sampled" token
        n = min(len(holder.all_ids) - holder.kv_len, CHUNK)
        if self.kv.extend(holder, n):
            self._compute(holder, n)
        else:
            self.retract(index)

    def finish(self, index: int) -> None:
        if self.running:
            self.kv.release(self.running.pop(index % len(self.running)))

    def retract(self, index: int) -> None:
        if self.running:
            holder = self.running.pop(index % len(self.running))
            self.kv.retract(holder)
            assert holder.row is None and holder.kv_len == holder.tree_len == 0

    def pin(self, tokens: list[int]) -> None:
        pin_id = f"client/{self.count}"
        self.count += 1
        self.kv.pin(pin_id, tokens)
        self.pins.append(pin_id)

    def unpin(self, index: int) -> None:
        if self.pins:
            assert self.kv.unpin(self.pins.pop(index % len(self.pins)))

    def evict(self, n: int) -> None:
        self.kv.tree.evict(n)

    def _compute(self, holder: Holder, n: int) -> None:
        """What a forward does to the pool: write the KV of the next n tokens into their slots."""
        row = self.kv.req_to_token[holder.row]
        for i in range(holder.kv_len, holder.kv_len + n):
            self.content[int(row[i])] = tuple(holder.all_ids[: i + 1])
        holder.kv_len += n
        self.kv.cache_unfinished(holder)

    # ---- checks --------------------------------------------------------------------------------
    def check(self) -> None:
        snapshot = self.kv.snapshot(self.running, [h.name for h in self.running])
        assert_slot_ownership(snapshot)
        self.kv.check(self.running)
        for holder in self.running:
            row = self.kv.req_to_token[holder.row, : holder.kv_len].tolist()
            for i, slot in enumerate(row):
                assert self.content[slot] == tuple(holder.all_ids[: i + 1]), (
                    f"{holder.name} reads another prefix's KV at position {i}"
                )

    def drain(self) -> None:
        while self.running:
            self.finish(0)
        while self.pins:
            self.unpin(0)
        assert self.kv.flush()
        assert_all_free(self.kv.snapshot([], []))


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=40)
index = st.integers(0, 100)
ops = scripts(
    [
        ("admit", tokens),
        ("step", index),
        ("step", index),
        ("finish", index),
        ("retract", index),
        ("pin", tokens),
        ("unpin", index),
        ("evict", st.integers(1, 48)),
    ],
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), script=ops)
def test_random_hand_overs_keep_ownership_and_contents(page_size, script):
    h = Harness(page_size)
    run_script(h, script)
    h.drain()


def test_second_request_reads_the_first_ones_pages():
    """A request admitted after another one's prefill shares its cached prefix, reading the same slots."""
    h = Harness(page_size=2)
    h.admit(list(range(1, 9)))
    first = h.running[0]
    h.admit(list(range(1, 9)) + [3, 3])
    second = h.running[1]
    free_before = h.kv.allocator.available()
    assert h.kv.req_to_token[second.row, :8].tolist() == h.kv.req_to_token[first.row, :8].tolist()
    h.step(1)  # a decoded token: one new page, nothing recomputed
    assert h.kv.allocator.available() == free_before - 2
    h.check()
    h.drain()


def test_admission_fails_cleanly_without_rows():
    h = Harness(page_size=1)
    for i in range(ROWS + 2):
        h.admit([i % 4, 9, 9, i])
    assert len(h.running) == ROWS
    h.check()
    h.drain()


def test_extension_evicts_unlocked_leaves_but_not_pins():
    h = Harness(page_size=4)
    h.admit(list(range(40)))  # 40 tokens over 5 steps of 8: all cached on release
    while h.running[0].kv_len < 40:
        h.step(0)
    h.finish(0)
    h.pin(list(range(16)))
    assert h.kv.tree.evictable_size == 40 - 16
    h.admit([7] * 60)  # needs more than the free slots: the unpinned leaf goes, the pin stays
    while h.running and h.running[0].kv_len < 60:
        h.step(0)
    h.check()
    assert len(h.kv.match_prefix(list(range(16))).slots) == 16
    h.drain()
