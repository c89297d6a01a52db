"""Radix tree of cached token prefixes mapping tokens to KV slots, with LRU leaf eviction.

With a host tier (`host`), a node's KV lives on the device, on the host, or on both:

| location    | `value` (device slots) | `host_value` (host slots) | how it gets there                       |
|-------------|------------------------|---------------------------|-----------------------------------------|
| device      | set                    | None                      | insertion of computed pages             |
| both        | set                    | set                       | a backup (write policy, swap) or a load |
| host        | None                   | set                       | device eviction of a backed-up node, a storage read |

Device nodes form a subtree at the root: a node on the device has its parent on the device, so a
match is a device part followed by a host part. Device eviction takes unlocked nodes with no
child on the device, LRU first; a node the host does not hold is backed up first when the write
policy or a host-only descendant asks for it, and otherwise removed with its (host-only) subtree.
Host memory is reclaimed from unlocked host-only leaves, LRU first.

Cache isolation: every key lives under the root of its salt (`roots`, salt -> root; "" is the
shared default `root`), so a request with one salt never matches, and never times, a prefix
cached under another. Eviction is one LRU over the leaves of all roots; an emptied root other
than the default is dropped.

KV events: with an event sink (`events`, `kv_events.KVEventSink`) every node keeps the chained
digests of its pages (`digests`), and the tree reports each page as it gets a device copy
(insertion, load-back) or a host copy (backup, storage read), loses one (eviction, host
reclaim), and everything at a flush. A split cuts the digests with the key; no event.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from radixrt.mem_cache.kv_events import MEDIUM_DEVICE, MEDIUM_HOST, KVEventSink

EMPTY = torch.empty(0, dtype=torch.int64)
SELECTIVE_HITS = 2  # write_through_selective backs a node up from its second use


class HostTier(Protocol):
    """What the tree needs of the host pool (`mem_cache.host_pool.HostKVPool` is one)."""

    def alloc(self, n: int) -> torch.Tensor | None: ...
    def free(self, slots: torch.Tensor) -> None: ...
    def available(self) -> int: ...
    def write(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None: ...
    def load(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None: ...


class TreeNode:
    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "host_value",
        "lock_ref",
        "hit_count",
        "last_access",
        "id",
        "digests",
        "state",
    )
    _ids = itertools.count()

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor | None,
        parent: TreeNode | None,
        host_value: torch.Tensor | None = None,
    ):
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # device KV slots of `key`, one per token; None when only on the host
        self.host_value = host_value  # host KV slots; None when the host holds no copy
        self.lock_ref = 0
        self.hit_count = 1  # its creation is its first use
        self.last_access = time.monotonic()
        self.id = next(TreeNode._ids)
        self.digests: list[bytes] = []  # one per page, with KV events on
        self.state: int | None = None  # a recurrent model's state slot after its last token

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def on_host(self) -> bool:
        return self.host_value is not None

    def device_len(self) -> int:
        return len(self.value) if self.value is not None else 0

    def device_slots(self) -> torch.Tensor:
        """`value`, of a node known to be on the device."""
        assert self.value is not None, "the node is not on the device"
        return self.value

    def host_slots(self) -> torch.Tensor:
        """`host_value`, of a node known to be on the host."""
        assert self.host_value is not None, "the host holds no copy of the node"
        return self.host_value

    def up(self) -> TreeNode:
        """`parent`, of a node known not to be a root."""
        assert self.parent is not None, "a root has no parent"
        return self.parent


class PrefixMatch(NamedTuple):
    """The longest cached page-aligned prefix of a key: the device slots of its first part and
    the node that ends it, then the host slots of the part only the host holds and the node
    ending that (`node` when there is none). `storage_tokens`: how many of the host part were
    just read from the disk tier. `unresumable`: for a recurrent model, the tokens the tree's KV
    matched past `node`, where no state snapshot lets a request resume."""

    slots: torch.Tensor
    node: TreeNode
    host_slots: torch.Tensor = EMPTY
    host_node: TreeNode | None = None
    storage_tokens: int = 0
    unresumable: int = 0

    @property
    def end_node(self) -> TreeNode:
        return self.host_node if self.host_node is not None else self.node

    @property
    def length(self) -> int:
        """Tokens matched on the device and the host together."""
        return len(self.slots) + len(self.host_slots)


class PrefixPeek(NamedTuple):
    """What `RadixCache.peek_prefix` saw: the `length` a match would have (device and host
    parts), the last `node` it reaches into and how many of that node's tokens it covers
    (`into`; len(node.key) when it covers the whole node, 0 at a root)."""

    length: int
    node: TreeNode
    into: int


class _LRUSet:
    """Nodes that may be evicted, oldest `last_access` first: a set plus a lazy heap."""

    def __init__(self) -> None:
        self.members: set[TreeNode] = set()
        self._heap: list[tuple[float, int, TreeNode]] = []

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.members

    def set(self, node: TreeNode, member: bool) -> None:
        if not member:
            self.members.discard(node)
            return
        self.members.add(node)
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 4 * len(self.members) + 64:  # drop stale entries
            self._heap = [(n.last_access, n.id, n) for n in self.members]
            heapq.heapify(self._heap)

    def pop(self) -> TreeNode | None:
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node in self.members and stamp == node.last_access:
                self.members.discard(node)
                return node
        return None  # stale entries (node changed since it was pushed) are skipped above


class RadixCache:
    """Prefix tree over token ids in units of pages.

    `evictable_size` counts device tokens of unlocked nodes, `protected_size` of locked ones; a
    node is locked while any running request uses its prefix. Eviction removes unlocked nodes
    with no child on the device, least recently used first.
    """

    def __init__(
        self,
        page_size: int,
        free_slots: Callable[[torch.Tensor], None],
        disable: bool = False,
        host: HostTier | None = None,
        write_policy: str = "write_through_selective",  # CacheSettings checks the name
        events: KVEventSink | None = None,
        drop_state: Callable[[TreeNode], None] | None = None,
    ):
        self.page_size = page_size
        self.free_slots = free_slots
        self.drop_state = drop_state  # a node's state snapshot goes with its KV
        self.disable = disable
        self.host = host
        self.write_policy = write_policy
        self.events = events
        self.reset()

    def reset(self) -> None:
        self.roots: dict[str, TreeNode] = {}
        self._root_salts: dict[int, str] = {}  # root node id -> its salt
        self.root = self._root("")
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_tokens = 0
        self.backed_up_tokens = 0  # device -> host copies
        self.loaded_tokens = 0  # host -> device copies
        self._device_lru = _LRUSet()  # unlocked nodes with no child on the device
        self._host_lru = _LRUSet()  # unlocked host-only leaves

    @property
    def sharing(self) -> bool:
        """Whether prefixes are cached and matched at all (`disable` is off)."""
        return not self.disable

    # ---- lookup and insertion -------------------------------------------------------------
    def _root(self, salt: str) -> TreeNode:
        """The root keys of `salt` hang under (made on first use; never evicted, never locked)."""
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = TreeNode([], EMPTY, None, EMPTY)
            root.lock_ref = 1
            self._root_salts[root.id] = salt
        return root

    def _prune(self, node: TreeNode) -> None:
        """Drop a salted root that holds nothing any more (the default root stays)."""
        if node.parent is None and not node.children and node is not self.root:
            salt = self._root_salts.pop(node.id, None)
            if salt is not None and self.roots.get(salt) is node:
                del self.roots[salt]

    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def match_prefix(self, key: list[int], salt: str = "") -> PrefixMatch:
        """The longest cached page-aligned prefix of `key` under `salt`: its device part, then
        its host part."""
        root = self.roots.get(salt)
        if self.disable or root is None:  # a salt nothing was cached under: no root made for it
            return PrefixMatch(EMPTY, self.root)
        node, device_node = root, root
        values: list[torch.Tensor] = []
        host_values: list[torch.Tensor] = []
        now = time.monotonic()
        key = key[: len(key) - len(key) % self.page_size]
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            if child.on_device:
                values.append(child.device_slots())
                device_node = child
            else:
                host_values.append(child.host_slots())
            node, key = child, key[n:]
        return PrefixMatch(
            torch.cat(values) if values else EMPTY,
            device_node,
            torch.cat(host_values) if host_values else EMPTY,
            node if host_values else None,
        )

    def peek_prefix(self, key: list[int], salt: str = "") -> PrefixPeek:
        """How far `match_prefix` would match `key` under `salt`, without its side effects: no
        node is split and no LRU time is touched, so ordering waiting requests by their matches
        leaves the tree (and eviction order) as it was."""
        root = self.roots.get(salt)
        if self.disable or root is None:
            return PrefixPeek(0, self.root, 0)
        node, length, into = root, 0, 0
        key = key[: len(key) - len(key) % self.page_size]
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            node, length, into = child, length + n, n
            if n < len(child.key):
                break
            key = key[n:]
        return PrefixPeek(length, node, into)

    def insert(self, key: list[int], value: torch.Tensor, salt: str = "") -> int:
        """Cache `key` -> device slots `value` (page-aligned length) under `salt`. Returns how
        many leading tokens the device already held: the caller's slots for those are duplicates
        it must free. Nodes only the host held take the caller's slots as their device copy."""
        node, done, duplicates = self._root(salt), 0, 0
        now = time.monotonic()
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                leaf = self._add_leaf(node, rest, value[done:].clone(), now)
                if self.host is not None and self.write_policy == "write_through":
                    self.backup(leaf)
                return duplicates
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            if child.on_device:
                duplicates = done + n
            else:
                self._set_device(child, value[done : done + n].clone())
            self._touch(child, now)
            node, done = child, done + n
        return duplicates

    def attach_host(self, parent: TreeNode, key: list[int], host_slots: torch.Tensor) -> TreeNode:
        """A new host-only child of `parent` (KV read from storage into the host pool)."""
        assert self._child_key(key) not in parent.children, "the key is already cached"
        node = TreeNode(key, None, parent, host_slots)
        parent.children[self._child_key(key)] = node
        self._refresh(node)
        self._refresh(parent)
        self._stored(node, MEDIUM_HOST)
        return node

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float
    ) -> TreeNode:
        node = TreeNode(key, value, parent)
        node.last_access = now
        parent.children[self._child_key(key)] = node
        self._account(node, +1)
        self._refresh(node)
        self._refresh(parent)
        self._stored(node, MEDIUM_DEVICE)
        return node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; return the new upper node."""
        upper = TreeNode(
            child.key[:n],
            None if child.value is None else child.value[:n],
            child.parent,
            None if child.host_value is None else child.host_value[:n],
        )
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hit_count = child.hit_count
        cut = n // self.page_size
        upper.digests, child.digests = child.digests[:cut], child.digests[cut:]
        upper.children = {self._child_key(child.key[n:]): child}
        child.up().children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = None if child.value is None else child.value[n:]
        child.host_value = None if child.host_value is None else child.host_value[n:]
        self._refresh(upper)
        return upper

    # ---- locks and sizes -------------------------------------------------------------------
    def _account(self, node: TreeNode, sign: int) -> None:
        if node.lock_ref:
            self.protected_size += sign * node.device_len()
        else:
            self.evictable_size += sign * node.device_len()

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= node.device_len()
                self.protected_size += node.device_len()
            node.lock_ref += 1
            self._refresh(node)
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "lock count underflow"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= node.device_len()
                self.evictable_size += node.device_len()
                self._refresh(node)
            node = node.parent

    # ---- where a node's KV lives ---------------------------------------------------------
    def _set_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give a host-only node (whose parent is on the device) a device copy."""
        assert node.value is None and node.up().on_device
        node.value = slots
        self._account(node, +1)
        self._refresh(node)
        self._refresh(node.up())
        self._stored(node, MEDIUM_DEVICE)

    def _drop_device(self, node: TreeNode) -> None:
        """The node's device KV freed; its state snapshot stays while the host holds its KV
        (a request resuming there loads that back), else goes with it."""
        if node.state is not None and self.drop_state is not None and not node.on_host:
            self.drop_state(node)
        self.free_slots(node.device_slots())
        self.evicted_tokens += len(node.device_slots())
        self._account(node, -1)
        node.value = None
        self._refresh(node)
        self._refresh(node.up())
        if self.events is not None:
            self.events.removed(node.digests, MEDIUM_DEVICE)

    def _remove(self, node: TreeNode) -> None:
        """Take a node with no device copy out of the tree, its (host-only) subtree with it."""
        for child in list(node.children.values()):
            self._remove(child)
        if node.state is not None and self.drop_state is not None:
            self.drop_state(node)
        if node.host_value is not None:
            self._host().free(node.host_value)
            if self.events is not None:
                self.events.removed(node.digests, MEDIUM_HOST)
        self._device_lru.set(node, False)
        self._host_lru.set(node, False)
        parent = node.up()
        del parent.children[self._child_key(node.key)]
        self._refresh(parent)
        self._prune(parent)

    def _host(self) -> HostTier:
        """The host tier, where the caller's state implies there is one."""
        assert self.host is not None, "no host tier"
        return self.host

    def backup(self, node: TreeNode) -> bool:
        """Copy a device node's KV to the host (reclaiming host memory if needed); False when the
        host cannot make room."""
        if node.on_host:
            return True
        host = self._host()
        n = len(node.device_slots())
        slots = host.alloc(n)
        if slots is None:
            self.evict_host(n - host.available())
            slots = host.alloc(n)
            if slots is None:
                return False
        host.write(slots, node.device_slots())
        node.host_value = slots
        self.backed_up_tokens += n
        self._stored(node, MEDIUM_HOST)
        return True

    def backup_path(self, node: TreeNode) -> int:
        """Back up the nodes from the root to `node` (a retracted request's prefix), top down
        until the host is full; returns how many of its tokens the host holds."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        kept = 0
        for node in reversed(path):
            if not self.backup(node):
                break
            kept += len(node.key)
        return kept

    def record_hit(self, node: TreeNode) -> None:
        """A request is about to use the prefix ending at `node`: count a use of each node on
        it, and back up those that reach the selective policy's threshold."""
        while node.parent is not None:
            node.hit_count += 1
            if (
                self.host is not None
                and self.write_policy == "write_through_selective"
                and node.hit_count >= SELECTIVE_HITS
                and node.on_device
            ):
                self.backup(node)
            node = node.parent

    def load_back(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Copy the host-only nodes of the path ending at `node` into device `slots` (as many as
        their tokens, in path order) and record them as on the device too."""
        path = []
        while not node.on_device:
            path.append(node)
            node = node.up()
        start = 0
        for node in reversed(path):
            part = slots[start : start + len(node.key)]
            self._host().load(part, node.host_slots())
            self._set_device(node, part)
            start += len(node.key)
        assert start == len(slots), "load-back slots do not cover the host part"
        self.loaded_tokens += start

    # ---- eviction --------------------------------------------------------------------------
    def _touch(self, node: TreeNode, now: float) -> None:
        node.last_access = now
        self._refresh(node)

    def _refresh(self, node: TreeNode) -> None:
        """Re-file a node in the eviction sets after its location, lock or children changed."""
        if node.parent is None:
            return
        free = node.lock_ref == 0
        self._device_lru.set(
            node,
            free and node.on_device and not any(c.on_device for c in node.children.values()),
        )
        self._host_lru.set(node, free and not node.on_device and not node.children)

    def _keep_on_host(self, node: TreeNode) -> bool:
        """Whether a device node about to be evicted should be backed up first: always under
        write_back and write_through (which may have found the host full before); under the
        selective policy once reused, or while the host has free room for it (free host memory
        serves nobody, and a chat's history is evicted before its next turn reuses it); and
        whenever host-only nodes below it need it."""
        return self.host is not None and (
            self.write_policy != "write_through_selective"
            or node.hit_count >= SELECTIVE_HITS
            or bool(node.children)
            or self.host.available() >= len(node.device_slots())
        )

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots if unlocked nodes allow; returns slots freed."""
        freed = 0
        while freed < num_tokens:
            node = self._device_lru.pop()
            if node is None:
                break
            freed += len(node.device_slots())
            if not node.on_host and self._keep_on_host(node):
                self.backup(node)
            on_host = node.on_host
            self._drop_device(node)
            if not on_host:
                self._remove(node)
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots from unlocked host-only leaves, LRU first."""
        freed = 0
        while freed < num_tokens:
            node = self._host_lru.pop()
            if node is None:
                break
            freed += len(node.host_slots())
            self._remove(node)
        return freed

    def flush(self) -> bool:
        """Drop every cached prefix, on the device and the host; only when no request holds a
        lock."""
        if any(child.lock_ref for root in self.roots.values() for child in root.children.values()):
            return False
        for node in self.all_nodes():
            if node.parent is not None:
                if node.state is not None and self.drop_state is not None:
                    self.drop_state(node)
                if node.on_device:
                    self.free_slots(node.device_slots())
                if node.on_host:
                    self._host().free(node.host_slots())
        self.reset()
        if self.events is not None:
            self.events.cleared()
        return True

    # ---- KV events --------------------------------------------------------------------------
    def _stored(self, node: TreeNode, medium: str) -> None:
        """Report `node`'s pages as held on `medium`, hashing them first if they are new."""
        events = self.events
        if events is None:
            return
        parent = root = node.up()
        while root.parent is not None:
            root = root.parent
        salt = self._root_salts[root.id]
        parent_digest = parent.digests[-1] if parent.parent is not None else None
        if not node.digests:
            node.digests = events.digests(parent_digest, node.key, salt)
        events.stored(node.digests, parent_digest, node.key, medium, salt)

    # ---- checks ----------------------------------------------------------------------------
    def all_nodes(self) -> list[TreeNode]:
        nodes, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check(self) -> None:
        """Assert invariant 3: consistent sizes, aligned keys, distinct slots, lock counts, and
        every node's location (held somewhere; on the device only below a device parent)."""
        evictable = protected = 0
        slots: list[torch.Tensor] = []
        host_slots: list[torch.Tensor] = []
        for node in self.all_nodes():
            if node.parent is None:
                salt = self._root_salts.get(node.id)
                assert salt is not None and self.roots.get(salt) is node, "a stray root"
                continue
            assert len(node.key) > 0 and len(node.key) % self.page_size == 0
            assert node.on_device or node.on_host, "a node is held nowhere"
            assert not node.on_device or node.parent.on_device, "a device node under a host one"
            assert node.parent.children.get(self._child_key(node.key)) is node
            locked_children = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= locked_children >= 0, "a child holds more locks than its parent"
            if node.value is not None:
                assert len(node.value) == len(node.key)
                slots.append(node.value)
            if node.host_value is not None:
                assert self.host is not None and len(node.host_value) == len(node.key)
                host_slots.append(node.host_value)
            if node.lock_ref:
                protected += node.device_len()
            else:
                evictable += node.device_len()
            device_leaf = node.on_device and not any(c.on_device for c in node.children.values())
            assert (node in self._device_lru) == (device_leaf and node.lock_ref == 0)
            host_leaf = not node.on_device and node.is_leaf
            assert (node in self._host_lru) == (host_leaf and node.lock_ref == 0)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"sizes drifted: {(evictable, protected)} != {(self.evictable_size, self.protected_size)}"
        )
        for held in (slots, host_slots):
            if held:
                flat = torch.cat(held)
                # torch leaves Tensor.unique unannotated
                unique = flat.unique()  # type: ignore[no-untyped-call]
                assert len(unique) == len(flat), "two nodes share a KV slot"
                assert int(flat.min()) >= self.page_size, "a node points at the padding page"
