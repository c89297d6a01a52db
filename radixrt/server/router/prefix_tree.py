"""The router's picture of one worker's cache: a radix tree of the token ids it sent there.

It is approximate by design: the worker evicts on its own schedule and the router never asks. So
the tree is bounded by the worker's pool size and forgets least recently used leaves first, as
the worker's own tree does; a prefix the router still remembers is likely, not certain, to be
cached there. No model, no torch: plain lists of ints.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    key: list[int]  # the tokens on the edge into this node
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ApproxPrefixTree:
    """Token prefixes with LRU leaf eviction past `capacity` tokens.

    Contract: `match(tokens)` is the length of the longest prefix of `tokens` inserted and not
    since evicted (asking does not refresh it: only `insert`, the request really sent, does);
    `size` is the number of tokens held (each shared prefix counted once) and
    stays `<= capacity` after every `insert`.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.root = _Node([], None)
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, tokens: list[int]) -> int:
        node, matched = self.root, 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            common = _common_length(child.key, tokens[matched:])
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, tokens: list[int]) -> None:
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(list(tokens[pos:]), node, last_access=now)
                node.children[tokens[pos]] = leaf
                self.size += len(leaf.key)
                break
            common = _common_length(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common
        if self.size > self.capacity:
            self._evict(self.size - self.capacity)

    def clear(self) -> None:
        self.root, self.size = _Node([], None), 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; return the new upper node."""
        upper = _Node(child.key[:at], child.parent, last_access=child.last_access)
        upper.parent.children[child.key[0]] = upper
        child.key, child.parent = child.key[at:], upper
        upper.children[child.key[0]] = child
        return upper

    def _evict(self, tokens: int) -> None:
        """Drop least recently used leaves until `tokens` are gone (a leaf's parent may become
        the next leaf). Evicting a tenth more than asked keeps this off most inserts."""
        target = self.size - tokens - self.capacity // 10
        while self.size > max(target, 0):
            leaves = sorted(self._leaves(), key=lambda n: n.last_access)
            if not leaves:
                break
            for leaf in leaves:
                if self.size <= max(target, 0):
                    break
                del leaf.parent.children[leaf.key[0]]
                self.size -= len(leaf.key)

    def _leaves(self) -> list[_Node]:
        stack, leaves = list(self.root.children.values()), []
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def check(self) -> None:
        """Invariants: sizes add up, edges are non-empty and keyed by their first token."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first and child.parent is node
                total += len(child.key)
                stack.append(child)
        assert total == self.size <= self.capacity, (total, self.size, self.capacity)
