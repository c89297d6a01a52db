"""The KV slot manager without a model: a real pool, a real tree and token ids, driven by random
operation sequences; slot ownership and KV contents are checked after every operation."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.config import HICACHE_WRITE_POLICIES
from radixrt.mem_cache.host_pool import HostKVPool
from radixrt.mem_cache.memory_pool import PageAllocator, ReqToTokenPool, TokenToKVPool
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.mem_cache.state_pool import StatePool
from radixrt.mem_cache.storage import KVStorage

from helpers import run_script, scripts
from ownership import assert_all_free, assert_slot_ownership

TOTAL_TOKENS = 96
ROWS = 6
CONTEXT = 64
CHUNK = 8
HOST_TOKENS = 64
BLOCK = 4  # disk-tier block: a whole number of pages for page sizes 1, 2 and 4
STATE_SLOTS = 8  # a recurrent model's: more than ROWS, fewer than the snapshots a script makes
SNAPSHOT_INTERVAL = 12  # a prefill's snapshots: some within CONTEXT, not at every chunk


@dataclass(eq=False)
class Holder:
    """A request as the manager sees it: token ids and its memory state."""

    all_ids: list[int]
    name: str
    row: int | None = None
    kv_len: int = 0
    tree_len: int = 0
    last_node: object = None
    state_slot: int | None = None
    snapshot_at: int = 0
    pins: list[str] = field(default_factory=list)
    cache_salt: str = ""


class Harness:
    """Runs requests through admit / extend / compute / cache / release / retract like the
    scheduler does, over a real one-number-per-token KV pool: each computed slot holds a number
    standing for the token prefix whose KV it is, so copies between tiers are checked by content.
    `tier`: None, or a host tier with that write policy (swap preemption on); `storage`: a disk
    tier directory under it."""

    def __init__(
        self,
        page_size: int,
        tier: str | None = None,
        storage: str | None = None,
        states: bool = False,
    ):
        allocator = PageAllocator(TOTAL_TOKENS, page_size, torch.device("cpu"))
        self.pool = TokenToKVPool(allocator.num_slots, 1, 1, 1, torch.float32, torch.device("cpu"))
        host = HostKVPool(self.pool, HOST_TOKENS, page_size) if tier else None
        tree = RadixCache(
            page_size, allocator.free, host=host, write_policy=tier or HICACHE_WRITE_POLICIES[0]
        )
        rows = ReqToTokenPool(ROWS, CONTEXT, torch.device("cpu"))
        # a recurrent model's state per slot: the number of the prefix it followed (0: none)
        self.state = torch.zeros(STATE_SLOTS)
        pool = StatePool(STATE_SLOTS, [self.state])
        disk = None
        if storage:
            like = host.device_block(torch.zeros(BLOCK, dtype=torch.long))
            layout = pool.layout if states else None
            disk = KVStorage(storage, 64 * 2**10, BLOCK, "harness", like, layout)
        self.kv = KVSlotManager(
            allocator,
            rows,
            tree,
            storage=disk,
            swap=tier is not None,
            states=pool if states else None,
            snapshot_interval=SNAPSHOT_INTERVAL,
        )
        self.running: list[Holder] = []
        self.ids: dict[tuple[int, ...], float] = {}  # prefix -> the number its KV is
        self.pins: list[str] = []
        self.count = 0

    # ---- operations ----------------------------------------------------------------------------
    def admit(self, tokens: list[int]) -> None:
        holder = Holder(list(tokens), f"r{self.count}")
        self.count += 1
        match = self.kv.match_prefix(holder.all_ids[:-1])  # at least one token is computed
        self.kv.lock(match.end_node)
        match = self.kv.load_back(match)
        n = min(len(tokens) - len(match.slots), CHUNK)
        holder.snapshot_at = self.kv.snapshot_point(holder, len(match.slots), match.unresumable)
        if holder.snapshot_at:  # the planner's rule: a chunk ends there
            n = min(n, holder.snapshot_at - len(match.slots))
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
        if holder.snapshot_at > holder.kv_len:  # the planner's rule: a chunk ends there
            n = min(n, holder.snapshot_at - holder.kv_len)
        if self.kv.extend(holder, n):
            self._compute(holder, n)
        else:
            self.retract(index)

    def finish(self, index: int) -> None:
        if self.running:
            self.kv.release(self.running.pop(index % len(self.running)))
            self._settle()

    def retract(self, index: int) -> None:
        if self.running:
            holder = self.running.pop(index % len(self.running))
            self.kv.retract(holder)
            self._settle()
            assert holder.row is None and holder.kv_len == holder.tree_len == 0

    def _settle(self) -> None:
        if self.kv.storage is not None:
            self.kv.storage.wait()  # the disk tier's writes run in the background

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
            prefix = tuple(holder.all_ids[: i + 1])
            self.pool.k_buffers[0][int(row[i])] = self.ids.setdefault(prefix, len(self.ids) + 1.0)
        slot = holder.state_slot
        if slot is not None:  # the recurrence resumes from its state (position 0: from zeros)
            if holder.kv_len:
                assert self.state[slot] == self.ids[tuple(holder.all_ids[: holder.kv_len])]
            self.state[slot] = self.ids[tuple(holder.all_ids[: holder.kv_len + n])]
        holder.kv_len += n
        self.kv.cache_unfinished(holder)

    # ---- checks --------------------------------------------------------------------------------
    def check(self) -> None:
        snapshot = self.kv.snapshot(self.running, [h.name for h in self.running])
        assert_slot_ownership(snapshot)
        self.kv.check(self.running)
        for node in self.kv.snapshots:
            path = []
            up = node
            while up.parent is not None:
                path = up.key + path
                up = up.parent
            assert self.state[node.state] == self.ids[tuple(path)], "a snapshot of another prefix"
        for holder in self.running:
            row = self.kv.req_to_token[holder.row, : holder.kv_len].long()
            for i, value in enumerate(self.pool.k_buffers[0][row].flatten().tolist()):
                assert value == self.ids[tuple(holder.all_ids[: i + 1])], (
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
@given(
    page_size=st.sampled_from([1, 2, 4]),
    tier=st.sampled_from([None, *HICACHE_WRITE_POLICIES]),
    storage=st.booleans(),
    script=ops,
)
def test_random_hand_overs_keep_ownership_and_contents(page_size, tier, storage, script):
    """With and without the host tier (swap on) and the disk tier: ownership of both pools and
    every running request's KV contents hold after every operation; a drain frees both pools."""
    with tempfile.TemporaryDirectory() as directory:
        h = Harness(page_size, tier, directory if tier and storage else None)
        run_script(h, script)
        h.drain()


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    tier=st.sampled_from([None, *HICACHE_WRITE_POLICIES]),
    storage=st.booleans(),
    script=ops,
)
def test_random_hand_overs_keep_a_recurrent_models_states(page_size, tier, storage, script):
    """A recurrent model's state slots beside the pool, with and without the host tier (swap
    on) and the disk tier: after every operation each slot has one owner, every running
    request's state is that of its computed prefix and every snapshot that of its node's path
    (checked by content: a state stands for the prefix it followed), so a request resumed from
    a snapshot, its KV on the device, loaded back from the host or read from disk, resumes the
    right state; a drain frees every slot."""
    with tempfile.TemporaryDirectory() as directory:
        h = Harness(page_size, tier, directory if tier and storage else None, states=True)
        run_script(h, script)
        h.drain()


def test_a_restart_resumes_a_recurrent_prompt_from_its_stored_state(tmp_path):
    """A recurrent model with a disk tier: a prompt's prefill stops at its last block boundary
    (and every snapshot interval), the states there are stored beside the blocks, and after a
    restart the same prompt with a new turn matches from disk up to the last stored state, its
    snapshot read into a slot of its own (the harness checks it is that prefix's state)."""
    h = Harness(page_size=2, tier="write_through", storage=str(tmp_path), states=True)
    tokens = list(range(1, 20)) + [0, 1, 2, 3]  # 23 tokens: interval 12, last block 20
    h.admit(tokens)
    while h.running[0].kv_len < len(tokens):
        h.step(0)
    h.finish(0)
    assert len(list(tmp_path.glob("*-state.safetensors"))) == 2  # after 12 and after 20
    assert h.kv.flush()
    fresh = Harness(page_size=2, tier="write_through", storage=str(tmp_path), states=True)
    fresh.ids = h.ids
    turn = [*tokens, 3, 2, 1]
    match = fresh.kv.match_prefix(turn[:-1])
    assert match.length == 20 and match.end_node.state is not None and not match.unresumable
    fresh.kv.lock(match.end_node)
    fresh.kv.unlock(fresh.kv.load_back(match).node)
    fresh.admit(turn)  # resumes at 20 from the state read from disk, contents checked
    fresh.check()
    fresh.drain()


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


def _finished(h: Harness, tokens: list[int]) -> None:
    """Run one request to completion of its prompt and release it."""
    h.admit(tokens)
    while h.running[-1].kv_len < len(tokens):
        h.step(len(h.running) - 1)
    h.finish(len(h.running) - 1)


def test_swap_out_keeps_a_retracted_requests_pages_on_the_host():
    h = Harness(page_size=2, tier="write_back")
    tokens = list(range(1, 21))
    h.admit(tokens)
    while h.running[0].kv_len < len(tokens):
        h.step(0)
    h.retract(0)
    assert h.kv.swapped_out_tokens == 20
    h.evict(TOTAL_TOKENS)  # the device forgets it all; the host still has it
    assert h.kv.tree.evictable_size == 0
    match = h.kv.match_prefix(tokens[:-1])
    assert len(match.slots) == 0 and len(match.host_slots) == 18
    h.admit(tokens)  # loads the 18 back (the last token is computed), contents checked
    assert h.kv.tree.loaded_tokens == 18
    h.check()
    h.drain()


def test_disk_tier_serves_a_prefix_after_both_pools_are_flushed(tmp_path):
    h = Harness(page_size=2, tier="write_through", storage=str(tmp_path))
    tokens = list(range(1, 22))
    _finished(h, tokens)
    assert len(list(tmp_path.glob("*.safetensors"))) == 5  # 20 tokens in blocks of 4
    assert h.kv.flush()
    fresh = Harness(page_size=2, tier="write_through", storage=str(tmp_path))  # a restart
    fresh.ids = h.ids
    match = fresh.kv.match_prefix(tokens[:-1])
    assert len(match.host_slots) == 20 and match.storage_tokens == 20
    fresh.kv.lock(match.end_node)
    fresh.kv.unlock(fresh.kv.load_back(match).node)
    fresh.admit(tokens)  # the 20 tokens read from disk, contents checked
    fresh.check()
    fresh.drain()


def test_disk_tier_skips_a_corrupt_file_and_stays_bounded(tmp_path):
    h = Harness(page_size=1, tier="write_through", storage=str(tmp_path))
    tokens = list(range(1, 14))
    _finished(h, tokens)
    files = sorted(tmp_path.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 3
    keys = h.kv.storage.block_keys(tokens, 3)
    second = tmp_path / f"{keys[1]}.safetensors"
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of KV
    second.write_bytes(bytes(data))
    (tmp_path / f"{keys[2]}.safetensors").write_bytes(b"truncated")
    assert h.kv.flush()
    match = h.kv.match_prefix(tokens[:-1])
    assert match.storage_tokens == 4  # block 0 only: the corrupt one ends the run
    assert h.kv.storage.rejected_blocks == 1 and not second.exists()
    h.kv.lock(match.end_node)
    h.kv.unlock(h.kv.load_back(match).node)
    h.drain()
    limit = h.kv.storage.max_bytes
    for first in range(40):  # many blocks: the oldest files go, the directory stays bounded
        _finished(h, [100 + first] * 9)
    assert sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) <= limit
    h.drain()
