"""Radix tree of cached token prefixes mapping tokens to KV slots, with LRU leaf eviction."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import NamedTuple

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None):
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # KV slots of `key`, one per token
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.id = next(TreeNode._ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children


class PrefixMatch(NamedTuple):
    """The longest cached page-aligned prefix of a key: its KV slots and the node that ends it."""

    slots: torch.Tensor
    node: TreeNode


class RadixCache:
    """Prefix tree over token ids in units of pages.

    `evictable_size` counts tokens of unlocked nodes, `protected_size` of locked ones; a node is
    locked while any running request uses its prefix. Eviction removes unlocked leaves, least
    recently used first, from an incrementally kept leaf set and a lazy heap.
    """

    def __init__(
        self, page_size: int, free_slots: Callable[[torch.Tensor], None], disable: bool = False
    ):
        self.page_size = page_size
        self.free_slots = free_slots
        self.disable = disable
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_tokens = 0
        self._evictable_leaves: set[TreeNode] = set()
        self._heap: list[tuple[float, int, TreeNode]] = []

    # ---- lookup and insertion -------------------------------------------------------------
    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def match_prefix(self, key: list[int]) -> PrefixMatch:
        """Slots of the longest cached page-aligned prefix of `key`, and the node ending it."""
        if self.disable:
            return PrefixMatch(self.root.value, self.root)
        node, values = self.root, []
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
            values.append(child.value)
            node, key = child, key[n:]
        return PrefixMatch(torch.cat(values) if values else self.root.value, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache `key` -> `value` (page-aligned length). Returns how many leading tokens were
        already cached: the caller's slots for those are duplicates it must free."""
        node, done = self.root, 0
        now = time.monotonic()
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                self._add_leaf(node, rest, value[done:].clone(), now)
                return done
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            node, done = child, done + n
        return done

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float) -> None:
        node = TreeNode(key, value, parent)
        node.last_access = now
        self._evictable_leaves.discard(parent)
        parent.children[self._child_key(key)] = node
        self._account(node, +1)
        self._update_leaf_state(node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; return the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        return upper

    # ---- locks and sizes -------------------------------------------------------------------
    def _account(self, node: TreeNode, sign: int) -> None:
        if node.lock_ref:
            self.protected_size += sign * len(node.key)
        else:
            self.evictable_size += sign * len(node.key)

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "lock count underflow"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
                self._update_leaf_state(node)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------
    def _touch(self, node: TreeNode, now: float) -> None:
        node.last_access = now
        self._update_leaf_state(node)

    def _update_leaf_state(self, node: TreeNode) -> None:
        if node.is_leaf and node.lock_ref == 0 and node is not self.root:
            self._evictable_leaves.add(node)
            heapq.heappush(self._heap, (node.last_access, node.id, node))
            if len(self._heap) > 4 * len(self._evictable_leaves) + 64:  # drop stale entries
                self._heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
                heapq.heapify(self._heap)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if unlocked leaves allow; returns slots freed."""
        freed = 0
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node not in self._evictable_leaves or stamp != node.last_access:
                continue  # stale entry: node changed since it was pushed
            self._evictable_leaves.discard(node)
            self.free_slots(node.value)
            freed += len(node.value)
            self.evictable_size -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            self._update_leaf_state(parent)
        self.evicted_tokens += freed
        return freed

    def flush(self) -> bool:
        """Drop every cached prefix; only when no request holds a lock."""
        if self.protected_size:
            return False
        self.evict(self.evictable_size)
        return self.evictable_size == 0

    # ---- checks ----------------------------------------------------------------------------
    def all_nodes(self) -> list[TreeNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check(self) -> None:
        """Assert invariant 3: consistent sizes, aligned keys, distinct slots, lock counts."""
        evictable = protected = 0
        slots = []
        for node in self.all_nodes():
            if node is self.root:
                continue
            assert len(node.key) == len(node.value) > 0 and len(node.key) % self.page_size == 0
            assert node.parent.children.get(self._child_key(node.key)) is node
            locked_children = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= locked_children >= 0, "a child holds more locks than its parent"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            assert (node in self._evictable_leaves) == (node.is_leaf and node.lock_ref == 0)
            slots.append(node.value)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"sizes drifted: {(evictable, protected)} != {(self.evictable_size, self.protected_size)}"
        )
        if slots:
            flat = torch.cat(slots)
            assert len(flat.unique()) == len(flat), "two nodes share a KV slot"
            assert int(flat.min()) >= self.page_size, "a node points at the padding page"
