"""The hand-over of KV slots between requests and the radix tree, in one place.

Ownership of KV pages (every page of the pool has exactly one owner at any time):

| owner                        | what it holds                                  | how it gets it / gives it up          |
|------------------------------|------------------------------------------------|---------------------------------------|
| the allocator (free)         | its free page list (frees merged lazily)       | `free` from the others / `alloc_*`    |
| the radix tree               | every node's `value`: whole pages              | `cache_unfinished`, `release` (insert) / eviction of an unlocked leaf, `flush` |
| one request, privately       | `row[tree_len:kv_len]`, filled from a page's start; its partly filled last page | `extend` (allocation) / `release`, `trim` (rejected drafts) |

- `row[:tree_len]` of a running request points at the tree's slots of its prefix; it only reads
  them, and holds a lock on the node that ends there (`last_node`), so eviction cannot take them.
- Moving request -> tree (after a prefill chunk, at finish, at retraction) inserts the computed
  whole pages; pages the tree already had a copy of are freed then, and the row is remapped to
  the tree's copy.
- Tree -> allocator only by eviction of an unlocked leaf (LRU) or by `flush`.
- A pin (a fork's shared prefix) is a lock on a node held for a client, not for a request.
- Page 0 (slot 0 in particular) is padding owned by nobody: padded gathers read it, masks hide it.

With a host tier the tree also owns host pages (`node.host_value`); see `radix_cache`. A match's
host part is loaded back into fresh device pages at admission (`load_back`); with swap
preemption a retracted request's computed pages join the tree and are backed up to the host
(`retract`), so its readmission loads them back instead of recomputing them. With a disk tier
finished and retracted requests' whole blocks are written to storage (`release`), and a match
that ends early reads the following blocks into the host pool (`match_prefix`).

A recurrent model's states (`state_pool.StatePool`) are handed over with the KV: a request
holds one state slot while it has a row; a match is cut back to the deepest node holding a
state snapshot (KV alone cannot resume the recurrence), and the tokens the tree's KV covers past
it are the request's first chunk (`PrefixMatch.unresumable`), after which the request's state is
copied into a snapshot there: the point where later requests branch off. A prompt's prefill also
stops for a snapshot every SNAPSHOT_INTERVAL tokens, so a request that branches off a prefix
another is still computing (or computed in one chunk) resumes near the branch point. A request
that ends (or is retracted) gives its slot to the node ending at its computed tokens when that
node holds none. Snapshots stay with their node while the device or the host tier holds its KV
(a state slot stands for a node's whole prefix, a small part of its KV's bytes, so it stays on
the device when the KV goes to the host: loading the KV back resumes from it; with swap
preemption a retracted request resumes where it stopped), go when the tree drops the node, and
the unlocked one worth least (`least_worth`: recency and the compute it saves) is dropped when
a request needs a slot and none is free.
With a disk tier a snapshot that ends at a block boundary is stored too (`KVStorage.write_state`,
beside the blocks' KV), and a prompt's prefill stops for one at its last block boundary as
well, so a restarted server resumes a seen prompt from disk: a match that ends early reads the
following blocks up to the deepest one with a state stored after it, that state into a slot of
its own as the snapshot of the node read.

The manager needs no model: the tests drive it with a pool, a tree and token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixrt.mem_cache.host_pool import HostKVPool
from radixrt.mem_cache.kv_events import ZmqEventPublisher
from radixrt.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from radixrt.mem_cache.radix_cache import PrefixMatch, PrefixPeek, RadixCache, TreeNode
from radixrt.mem_cache.state_pool import StatePool
from radixrt.mem_cache.storage import KVStorage

# A host part shorter than this is recomputed instead: a load has a fixed cost (two copies per
# layer; 0.2 ms for 1 to 16 tokens of the default model on a 2-core CPU, 0.6 ms for 64) that a
# few tokens riding along in the step's extend undercut on a fast device. SGLang's is 10.
LOAD_BACK_MIN_TOKENS = 4
# a recurrent model's prefill keeps a state snapshot at every multiple of this many tokens (of
# whole pages): a prompt branching off another's resumes at most this far before the branch
SNAPSHOT_INTERVAL = 256


class SlotHolder(Protocol):
    """What the manager reads and writes of a request (`engine.request.Req` is one)."""

    all_ids: list[int]  # the tokens whose KV the request needs, prompt then output
    row: int | None  # its row in the request->token table while it holds slots
    kv_len: int  # tokens of all_ids whose K/V are in the pool
    tree_len: int  # row[:tree_len] belongs to the tree, locked through last_node
    last_node: TreeNode | None
    state_slot: int | None  # a recurrent model's state slot while it has a row
    snapshot_at: int  # where its state is next kept as a snapshot (`snapshot_point`); 0: nowhere

    @property
    def cache_salt(self) -> str:
        """The tree (and disk-tier) namespace its prefixes are matched and cached in."""
        ...


def _locked(holder: SlotHolder) -> TreeNode:
    """The node a holder with a row locks its tree part through."""
    assert holder.last_node is not None, "the holder holds no slots"
    return holder.last_node


@dataclass(frozen=True)
class KVUsage:
    """How KV memory is used now, and what the tiers counted: what the scheduler's `stats()`
    and logs read, instead of reaching into the tree, the allocator and the tiers."""

    total_tokens: int
    free_tokens: int  # on the allocator's free list
    evictable_tokens: int  # cached in unlocked tree nodes
    protected_tokens: int  # cached in locked tree nodes
    cache_salts: int  # tree roots (the default one and one per salt in use)
    evicted_tokens: int
    free_rows: int  # request -> token table rows
    peak_used_tokens: int
    pins: int
    host_total_tokens: int
    host_used_tokens: int
    storage_rejected_blocks: int
    swapped_out_tokens: int
    state_total_slots: int  # a recurrent model's state slots (0 for any other)
    state_free_slots: int
    state_cached_slots: int  # held by tree nodes as snapshots
    kv_event_batches: int  # published (--kv-events-config)
    kv_event_dropped_batches: int  # lost to a full queue

    @property
    def used_fraction(self) -> float:
        return 1 - self.free_tokens / self.total_tokens


@dataclass(frozen=True)
class Pin:
    """A client's lock on a cached prefix: the node locked, how many tokens it ends, and whose
    quota it counts against (`owner`: a tenant, or one client connection)."""

    node: TreeNode
    tokens: int
    owner: str = ""


class KVSlotManager:
    """Allocates, hands over and frees KV slots for requests; owns the tree's locks and pins."""

    def __init__(
        self,
        allocator: PageAllocator,
        req_to_token_pool: ReqToTokenPool,
        tree: RadixCache,
        storage: KVStorage | None = None,
        swap: bool = False,
        publisher: ZmqEventPublisher | None = None,
        states: StatePool | None = None,
        snapshot_interval: int = SNAPSHOT_INTERVAL,
    ):
        """`tree.host` (a `HostKVPool` or None) is the host tier; `storage` the disk tier (needs
        the host tier); `swap`: retraction backs a request's pages up to the host; `publisher`
        sends the tree's KV events (`end_event_batch`); `states`: a recurrent model's state
        slots, kept as snapshots every `snapshot_interval` tokens of a prefill too."""
        assert storage is None or tree.host is not None, "the disk tier reads through the host"
        self.allocator = allocator
        self.rows = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.tree = tree
        host = tree.host
        assert host is None or isinstance(host, HostKVPool), "the host tier is a HostKVPool"
        self.host: HostKVPool | None = host
        self.storage = storage
        self.publisher = publisher
        self.swap = swap and tree.host is not None and not tree.disable
        self.page_size = allocator.page_size
        self.total_tokens = allocator.total_tokens  # the device pool's size
        self.pins: dict[str, Pin] = {}  # pin id -> what is locked on a client's behalf
        self.peak_used_tokens = 0
        self.swapped_out_tokens = 0
        self.states = states
        self.snapshot_interval = snapshot_interval - snapshot_interval % self.page_size
        self.snapshot_interval = max(self.snapshot_interval, self.page_size)
        self.snapshots: set[TreeNode] = set()  # the nodes holding a state slot
        tree.drop_state = self._drop_snapshot

    # ---- room ------------------------------------------------------------------------------
    def slots_needed(self, holder: SlotHolder, n: int) -> int:
        """Slots the holder must take from the allocator for n more tokens (whole pages)."""
        p = self.page_size
        room = min((-holder.kv_len) % p, n)  # the holder's own partly filled last page
        return -(-(n - room) // p) * p

    def available(self) -> int:
        """Slots that could be had now: free, or held by unlocked tree nodes."""
        return self.allocator.available() + self.tree.evictable_size

    def used_tokens(self) -> int:
        return self.allocator.total_tokens - self.allocator.available()

    def free_rows(self) -> int:
        """Rows of the request -> token table a new request could take (with a recurrent
        model's states, no more than the state slots free or held by unlocked snapshots)."""
        rows = self.rows.available()
        if self.states is None:
            return rows
        spare = sum(1 for node in self.snapshots if not node.lock_ref)
        return min(rows, self.states.available() + spare)

    @property
    def sharing(self) -> bool:
        """Whether prefixes are cached and matched at all (not `--disable-radix-cache`)."""
        return self.tree.sharing

    def usage(self) -> KVUsage:
        tree, host, storage = self.tree, self.host, self.storage
        return KVUsage(
            total_tokens=self.total_tokens,
            free_tokens=self.allocator.available(),
            evictable_tokens=tree.evictable_size,
            protected_tokens=tree.protected_size,
            cache_salts=len(tree.roots),
            evicted_tokens=tree.evicted_tokens,
            free_rows=self.rows.available(),
            peak_used_tokens=self.peak_used_tokens,
            pins=len(self.pins),
            host_total_tokens=host.total_tokens if host else 0,
            host_used_tokens=host.used_tokens() if host else 0,
            storage_rejected_blocks=storage.rejected_blocks if storage else 0,
            swapped_out_tokens=self.swapped_out_tokens,
            state_total_slots=self.states.total if self.states else 0,
            state_free_slots=self.states.available() if self.states else 0,
            state_cached_slots=len(self.snapshots),
            kv_event_batches=self.publisher.counts.published_batches if self.publisher else 0,
            kv_event_dropped_batches=self.publisher.counts.dropped_batches if self.publisher else 0,
        )

    def slots(self, holder: SlotHolder, start: int, n: int) -> torch.Tensor:
        """The slots of the holder's tokens start .. start + n (where a forward writes K/V)."""
        return self.req_to_token[holder.row, start : start + n]

    # ---- a request's life ------------------------------------------------------------------
    def peek_prefix(self, key: list[int], salt: str = "") -> PrefixPeek:
        """How much of `key` the tree holds under `salt`, changing nothing (for ordering; the
        disk tier is not read)."""
        return self.tree.peek_prefix(key, salt)

    def match_prefix(self, key: list[int], salt: str = "") -> PrefixMatch:
        """The cached prefix of `key` under `salt` on the device and the host, extended by the
        blocks the disk tier has after it (read into the host pool here), for an admission."""
        match = self.tree.match_prefix(key, salt)
        if self.storage is not None and not self.tree.disable:
            match = self._read_storage(key, match, salt)
        if self.states is not None:
            match = _resumable(match)
        return match

    def load_back(self, match: PrefixMatch) -> PrefixMatch:
        """Bring the host part of a match (locked through `match.end_node`) into fresh device
        pages; returns the device-only match, locked through its node. A host part shorter than
        LOAD_BACK_MIN_TOKENS, or one the device cannot make room for, is left to be recomputed."""
        if match.host_node is None:
            return match
        n = len(match.host_slots)
        slots = None
        if n >= LOAD_BACK_MIN_TOKENS:
            short = n - self.allocator.available()
            if short > 0:
                self.tree.evict(short)  # the matched path is locked, so it stays
            slots = self.allocator.alloc_extend(0, 0, n)
        if slots is None:  # the device part alone, cut back to a snapshot on it
            unresumable = match.unresumable + n
            device = PrefixMatch(match.slots, match.node, unresumable=unresumable)
            if self.states is not None:
                device = _resumable(device)
            self.tree.inc_lock_ref(device.node)
            self.tree.dec_lock_ref(match.host_node)
            return device
        self.tree.load_back(match.host_node, slots)
        self.peak_used_tokens = max(self.peak_used_tokens, self.used_tokens())
        return PrefixMatch(
            torch.cat([match.slots, slots]), match.host_node, unresumable=match.unresumable
        )

    def _read_storage(self, key: list[int], match: PrefixMatch, salt: str) -> PrefixMatch:
        """Extend `match` by the whole blocks of `key` the disk tier holds right after it: read
        them into new host pages hung under the match's end as one host-only node. A recurrent
        model reads them only up to the deepest block with a state stored after it (the KV past
        it would be recomputed), that state into a slot of its own: the node's snapshot."""
        storage, host, states = self.storage, self.host, self.states
        assert storage is not None and host is not None, "there is a disk tier"
        b = storage.block_tokens
        start, count = match.length, len(key) // b
        if start // b >= count:
            return match
        keys = storage.block_keys(key, count, salt)[start // b :]
        if states is not None:
            stored = [i for i, k in enumerate(keys) if storage.contains_state(k)]
            keys = keys[: stored[-1] + 1] if stored else []
        blocks = []
        for block_key in keys:
            kv = storage.read(block_key)
            if kv is None:
                break
            blocks.append(kv)
        state = None
        if states is not None:
            while blocks and (state := storage.read_state(keys[len(blocks) - 1])) is None:
                blocks.pop()  # resumable only where the state is: read the one before
        if not blocks:
            return match
        end = (start // b + len(blocks)) * b
        parent = match.end_node
        self.tree.inc_lock_ref(parent)  # reclaiming room must not take the matched path
        state_slot = self._state_slot() if state is not None else None
        slots = None
        if state is None or state_slot is not None:  # without a slot to resume in: no use
            slots = host.alloc(end - start)
            if slots is None:
                self.tree.evict_host(end - start - host.available())
                slots = host.alloc(end - start)
        self.tree.dec_lock_ref(parent)
        if slots is None:
            if states is not None and state_slot is not None:
                states.free(state_slot)
            return match
        host.put(slots, blocks, start % b)
        node = self.tree.attach_host(parent, key[start:end], slots)
        if states is not None and state is not None and state_slot is not None:
            states.load(state_slot, state)
            self._keep_snapshot(node, state_slot)
        return PrefixMatch(
            match.slots, match.node, torch.cat([match.host_slots, slots]), node, end - start
        )

    def _write_storage(self, holder: SlotHolder) -> None:
        """Queue the holder's computed whole blocks that the disk tier lacks."""
        storage, host = self.storage, self.host
        assert storage is not None and host is not None, "there is a disk tier"
        b = storage.block_tokens
        row = self.req_to_token[holder.row]
        keys = storage.block_keys(holder.all_ids, holder.kv_len // b, holder.cache_salt)
        for i, key in enumerate(keys):
            if not storage.contains(key):
                storage.write(key, host.device_block(row[i * b : (i + 1) * b].long()))

    def lock(self, node: TreeNode) -> None:
        """Protect a matched prefix from eviction while admission decides (see `admit`)."""
        self.tree.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)

    def record_hit(self, node: TreeNode) -> None:
        """A request is about to use the prefix ending at `node` (the selective write policy
        backs a prefix up from its second use)."""
        self.tree.record_hit(node)

    def admit(self, holder: SlotHolder, match: PrefixMatch, n: int) -> bool:
        """Give the holder a row that starts with the matched prefix (whose node the caller has
        locked: the lock passes to the holder) and slots for its next n tokens. On failure the
        holder holds nothing again, the lock included."""
        holder.row = self.rows.alloc()
        if holder.row is None:
            self.unlock(match.node)
            return False
        if self.states is not None:
            holder.state_slot = self._state_slot()
            if holder.state_slot is None:
                self.rows.free(holder.row)
                holder.row = None
                self.unlock(match.node)
                return False
            if match.node.state is not None:  # a copy: the node keeps its snapshot
                self.states.copy(match.node.state, holder.state_slot)
        m = len(match.slots)
        self.req_to_token[holder.row, :m] = match.slots.to(torch.int32)
        holder.kv_len = holder.tree_len = m
        holder.last_node = match.node
        if self.extend(holder, n):
            return True
        self.release(holder)
        return False

    def extend(self, holder: SlotHolder, n: int) -> bool:
        """Slots for the holder's next n tokens, evicting unlocked leaves if the free list is short;
        False (nothing taken) when even that is not enough."""
        short = self.slots_needed(holder, n) - self.allocator.available()
        if short > 0:
            self.tree.evict(short)
        row = self.req_to_token[holder.row]
        last = int(row[holder.kv_len - 1]) if holder.kv_len else 0
        slots = self.allocator.alloc_extend(last, holder.kv_len, n)
        if slots is None:
            return False
        row[holder.kv_len : holder.kv_len + n] = slots.to(torch.int32)
        self.peak_used_tokens = max(self.peak_used_tokens, self.used_tokens())
        return True

    def trim(self, holder: SlotHolder, allocated: int) -> None:
        """Free the holder's slots past kv_len up to `allocated` (what `extend` gave it): the K/V
        of rejected speculative drafts. Whole pages go back to the allocator; a page that still
        holds a computed token stays the holder's, its rest refilled by the next `extend`."""
        keep = -(-holder.kv_len // self.page_size) * self.page_size
        if allocated > keep:
            self.allocator.free(self.req_to_token[holder.row, keep:allocated].long())

    def cache_unfinished(self, holder: SlotHolder) -> None:
        """Hand the holder's computed whole pages to the tree and keep reading the tree's copies,
        so requests admitted after it share them."""
        if self.tree.disable or holder.kv_len - holder.kv_len % self.page_size <= holder.tree_len:
            return  # with matching off nobody could reuse the pages before the request ends
        aligned = self._insert_computed(holder)
        match = self.tree.match_prefix(holder.all_ids[:aligned], holder.cache_salt)
        self.req_to_token[holder.row, :aligned] = match.slots.to(torch.int32)
        self.tree.inc_lock_ref(match.node)
        self.tree.dec_lock_ref(_locked(holder))
        holder.last_node, holder.tree_len = match.node, aligned
        if self.states is not None and holder.snapshot_at == holder.kv_len == aligned:
            if match.node.state is None and (slot := self._state_slot()) is not None:
                assert holder.state_slot is not None, "a recurrent model's holder has a slot"
                self.states.copy(holder.state_slot, slot)
                self._keep_snapshot(match.node, slot)
                self._store_state(holder, aligned, slot)
            holder.snapshot_at = self.snapshot_point(holder, holder.kv_len)

    def release(self, holder: SlotHolder) -> None:
        """Give back everything: computed whole pages to the tree, the rest freed, the lock and
        the row dropped. The holder keeps kv_len (what it had computed) for its caller to read."""
        if holder.row is None:
            return
        if self.storage is not None:
            self._write_storage(holder)
        aligned = self._insert_computed(holder)
        start = max(aligned, holder.tree_len)
        if holder.kv_len > start:
            self.allocator.free(self.req_to_token[holder.row, start : holder.kv_len].long())
        if holder.state_slot is not None:
            self._hand_back_state(holder, aligned)
        self.tree.dec_lock_ref(_locked(holder))
        self.rows.free(holder.row)
        holder.row, holder.last_node = None, None

    # ---- a recurrent model's states -------------------------------------------------------
    def snapshot_point(self, holder: SlotHolder, start: int, unresumable: int = 0) -> int:
        """Where the holder, computed up to `start`, next stops for a state snapshot (0:
        nowhere): the end of the tokens a match's KV covered past `start` (`unresumable`, the
        branch point), or the next multiple of `snapshot_interval`, whichever comes first, short
        of its last token (its end keeps its state when it ends). Its scheduler ends a chunk
        there."""
        if self.states is None or self.tree.disable:
            return 0
        interval = self.snapshot_interval
        points = [(start // interval + 1) * interval]
        if unresumable:
            points.append(start + unresumable)
        if self.storage is not None:  # the last block boundary: what a restart resumes from
            b = self.storage.block_tokens
            points.append((len(holder.all_ids) - 2) // b * b)
        last = len(holder.all_ids) - 1
        return min((p for p in points if start < p < last), default=0)

    def forget_state(self, holder: SlotHolder) -> None:
        """Free the holder's state slot without keeping it as a snapshot: it ends with an error,
        and a failed step may have moved its state past its computed tokens."""
        if holder.state_slot is not None:
            assert self.states is not None
            self.states.free(holder.state_slot)
            holder.state_slot = None

    def _state_slot(self) -> int | None:
        """A free state slot, dropping the unlocked snapshot worth least (`least_worth`) if
        none is."""
        assert self.states is not None
        slot = self.states.alloc()
        if slot is None:
            spare = [node for node in self.snapshots if not node.lock_ref]
            if not spare:
                return None
            self._drop_snapshot(least_worth(spare))
            slot = self.states.alloc()
        return slot

    def _keep_snapshot(self, node: TreeNode, slot: int) -> None:
        node.state = slot
        self.snapshots.add(node)

    def _store_state(self, holder: SlotHolder, length: int, slot: int) -> None:
        """With a disk tier, queue the state in `slot` (the holder's after `length` tokens)
        when that ends a block and the tier lacks it."""
        storage = self.storage
        if storage is None or length % storage.block_tokens:
            return
        assert self.states is not None
        blocks = length // storage.block_tokens
        key = storage.block_keys(holder.all_ids, blocks, holder.cache_salt)[-1]
        if not storage.contains_state(key):
            storage.write_state(key, self.states.save(slot))

    def _drop_snapshot(self, node: TreeNode) -> None:
        """The tree drops `node`'s KV (or everything): its snapshot goes too."""
        assert self.states is not None and node.state is not None
        self.states.free(node.state)
        node.state = None
        self.snapshots.discard(node)

    def _hand_back_state(self, holder: SlotHolder, aligned: int) -> None:
        """An ending holder's state slot: a snapshot of the node its computed tokens end at,
        when they end at a node (whole pages, cached: not with matching off) that holds none;
        else free."""
        assert self.states is not None and holder.state_slot is not None
        slot, holder.state_slot, holder.snapshot_at = holder.state_slot, None, 0
        if not self.tree.disable and aligned == holder.kv_len > 0:
            node = self.tree.match_prefix(holder.all_ids[:aligned], holder.cache_salt).node
            if node.parent is not None and node.state is None:
                self._keep_snapshot(node, slot)
                self._store_state(holder, aligned, slot)
                return
        self.states.free(slot)

    def retract(self, holder: SlotHolder) -> None:
        """Release, and forget what was computed: the holder starts over (mostly from the tree).
        With swap, its computed whole pages are backed up to the host first, so readmission
        loads them back; whatever the host cannot take (and a partly filled last page) is
        recomputed."""
        if self.swap and holder.row is not None:
            self.cache_unfinished(holder)
            self.swapped_out_tokens += self.tree.backup_path(_locked(holder))
        self.release(holder)
        holder.kv_len = holder.tree_len = 0

    def _insert_computed(self, holder: SlotHolder) -> int:
        """Insert the holder's computed whole pages into the tree, freeing the ones it already
        had; returns how many tokens that covers."""
        aligned = holder.kv_len - holder.kv_len % self.page_size
        if aligned > holder.tree_len:
            row = self.req_to_token[holder.row]
            already = self.tree.insert(
                holder.all_ids[:aligned], row[:aligned].long(), holder.cache_salt
            )
            if already > holder.tree_len:
                self.allocator.free(row[holder.tree_len : already].long())
        return aligned

    # ---- pins ------------------------------------------------------------------------------
    def pin(self, pin_id: str, key: list[int], salt: str = "", owner: str = "") -> int:
        """Lock the cached prefix of `key` under `salt` until `unpin`, on `owner`'s behalf;
        returns how many tokens that is."""
        if pin_id in self.pins:
            raise ValueError(f"pin {pin_id!r} exists")
        match = self.tree.match_prefix(list(key), salt)
        self.tree.inc_lock_ref(match.node)
        self.pins[pin_id] = Pin(match.node, len(match.slots), owner)
        return len(match.slots)

    def pinned_tokens(self, owner: str) -> int:
        """Tokens held by `owner`'s pins; a prefix two pins share counts twice, so this bounds
        what they hold from above."""
        return sum(p.tokens for p in self.pins.values() if p.owner == owner)

    def pin_count(self, owner: str) -> int:
        return sum(p.owner == owner for p in self.pins.values())

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self.tree.dec_lock_ref(pin.node)
        return pin is not None

    def unpin_all(self, prefix: str) -> int:
        """Release every pin whose id starts with `prefix` (a vanished client's); returns how many."""
        ids = [pin_id for pin_id in self.pins if pin_id.startswith(prefix)]
        for pin_id in ids:
            self.unpin(pin_id)
        return len(ids)

    def end_event_batch(self) -> None:
        """Publish the KV events of the tree's changes since the last call as one batch (the
        scheduler calls it after each step, idle turn and flush)."""
        if self.tree.events is not None:
            self.tree.events.end_batch()

    def close(self) -> None:
        """Finish the disk tier's background writes and send the last KV events."""
        if self.storage is not None:
            self.storage.close()
        if self.publisher is not None:
            self.end_event_batch()
            self.publisher.close()

    def flush(self) -> bool:
        """Drop every cached prefix; only when nothing holds a lock."""
        if not self.tree.flush():
            return False
        self.peak_used_tokens = 0
        return True

    def forget_weights(self, label: str) -> None:
        """Never return KV computed before now (new weights): every pin released, the device and
        host tiers flushed, the disk tier re-seeded with `label` (unique to this update).
        RuntimeError while a request holds KV: the caller waits until none does."""
        self.unpin_all("")
        if not self.flush():
            raise RuntimeError("a request still holds KV; the cache cannot be forgotten")
        if self.storage is not None:
            self.storage.reseed(label)

    # ---- checks ----------------------------------------------------------------------------
    def snapshot(self, holders: Sequence[SlotHolder], names: list[str]) -> dict[str, Any]:
        """Who holds which slot, as plain data, for checkers that must not share this code:
        `pool_snapshot`, every holder's row split at tree_len and kv_len, the pinned nodes, the
        request-table rows."""
        return {
            **pool_snapshot(self.allocator, self.tree),
            "requests": [
                {
                    "rid": name,
                    "last_node": _locked(h).id,
                    "tree_slots": self.req_to_token[h.row, : h.tree_len].tolist(),
                    "own_slots": self.req_to_token[h.row, h.tree_len : h.kv_len].tolist(),
                }
                for h, name in zip(holders, names)
            ],
            "pinned_nodes": [p.node.id for p in self.pins.values()],
            "rows": self.rows.rows,
            "free_rows": self.rows.available(),
            "running_rows": [h.row for h in holders],
        }

    def check(self, holders: Sequence[SlotHolder]) -> None:
        """Invariants 2 and 3: every page has one owner, the tree is consistent, locks add up."""
        self.tree.check()
        p = self.page_size
        owners = [self.allocator.free_page_ids()]
        owners += [n.device_slots()[::p] // p for n in self.tree.all_nodes() if n.device_len()]
        for h in holders:
            owners.append(self.req_to_token[h.row, h.tree_len : h.kv_len][::p].long() // p)
        pages = torch.cat(owners).sort().values
        expected = torch.arange(1, self.allocator.num_pages + 1, device=pages.device)
        assert len(pages) == len(expected) and bool((pages == expected).all()), (
            "KV pages leaked or owned twice"
        )
        assert len({h.row for h in holders}) + self.rows.available() == self.rows.rows, (
            "request rows leaked"
        )
        if self.states is not None:
            slots = [h.state_slot for h in holders] + [n.state for n in self.snapshots]
            owned = self.states.free_slots() + [s for s in slots if s is not None]
            assert len(owned) == len(slots) + self.states.available(), "a holder lacks its slot"
            assert sorted(owned) == list(range(self.states.total)), (
                "state slots leaked or owned twice"
            )
            assert all(n.state is None for n in self.tree.all_nodes() if n not in self.snapshots)
        if self.host is not None:
            held = [
                n.host_slots()[::p] // p for n in self.tree.all_nodes() if len(n.key) and n.on_host
            ]
            pages = torch.cat([self.host.allocator.free_page_ids(), *held]).sort().values
            expected = torch.arange(1, self.host.allocator.num_pages + 1)
            assert len(pages) == len(expected) and bool((pages == expected).all()), (
                "host pages leaked or owned twice"
            )
        locks: dict[TreeNode, int] = {}
        for node in [_locked(h) for h in holders] + [p.node for p in self.pins.values()]:
            while node.parent is not None:
                locks[node] = locks.get(node, 0) + 1
                node = node.parent
        for node in self.tree.all_nodes():
            if node.parent is not None:
                assert node.lock_ref == locks.get(node, 0), (
                    "lock count differs from the holders of locks"
                )


def least_worth(snapshots: list[TreeNode]) -> TreeNode:
    """The snapshot to drop of `snapshots` (unlocked, each in one state slot: all the same
    bytes), by what keeping it saves per byte, as Marconi (arXiv 2411.19379) weighs them:
    its recency (last access, scaled to [0, 1] over the candidates) plus the compute it saves
    (scaled the same way): the tokens a request resuming there would otherwise recompute, from
    the nearest snapshot above it (or the start). Among snapshots saving alike, the least
    recently used goes, as LRU; a long conversation's end outlives a newer one-off prompt's."""
    saved = {}
    for node in snapshots:
        tokens, up = len(node.key), node.up()
        while up.parent is not None and up.state is None:
            tokens += len(up.key)
            up = up.parent
        saved[node] = tokens
    times = [node.last_access for node in snapshots]
    first, span = min(times), (max(times) - min(times)) or 1.0
    most = max(saved.values()) or 1
    return min(snapshots, key=lambda n: (n.last_access - first) / span + saved[n] / most)


def _resumable(match: PrefixMatch) -> PrefixMatch:
    """A recurrent model's match: cut back to the deepest node holding a state snapshot, on
    the device or the host part, the tokens cut off added to `unresumable`."""
    node, cut = match.end_node, 0
    while node.parent is not None and node.state is None:
        cut += len(node.key)
        node = node.parent
    if not cut:
        return match
    unresumable, host = match.unresumable + cut, len(match.host_slots)
    if cut < host:  # the snapshot's node is on the host
        return match._replace(
            host_slots=match.host_slots[: host - cut], host_node=node, unresumable=unresumable
        )
    kept = len(match.slots) - (cut - host)
    return PrefixMatch(match.slots[:kept], node, unresumable=unresumable)


def pool_snapshot(allocator: PageAllocator, tree: RadixCache) -> dict[str, Any]:
    """The allocator's and the tree's part of a snapshot: page size and count, the free pages,
    every tree node (device slots, host slots, lock count, parent) and, with a host tier, its
    page count and free pages."""

    def listed(slots: torch.Tensor | None) -> list[int]:
        return [] if slots is None else slots.tolist()

    snapshot = {
        "page_size": allocator.page_size,
        "num_pages": allocator.num_pages,
        "free_pages": allocator.free_page_ids().tolist(),
        "root": tree.root.id,
        "roots": [root.id for root in tree.roots.values()],
        "root_of_salt": {salt: root.id for salt, root in tree.roots.items()},
        "nodes": [
            {
                "id": n.id,
                "parent": n.parent.id,
                "key": n.key,
                "slots": listed(n.value),
                "host_slots": listed(n.host_value),
                "lock_ref": n.lock_ref,
            }
            for n in tree.all_nodes()
            if n.parent is not None
        ],
    }
    if tree.host is not None:
        assert isinstance(tree.host, HostKVPool), "the host tier is a HostKVPool"
        snapshot["host_num_pages"] = tree.host.allocator.num_pages
        snapshot["host_free_pages"] = tree.host.allocator.free_page_ids().tolist()
    return snapshot
