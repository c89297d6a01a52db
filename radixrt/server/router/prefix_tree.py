"""The router's picture of one worker's cache: a radix tree of the token ids it sent there, one
root per cache namespace.

It is approximate by design: the worker evicts on its own schedule and the router never asks. So
the tree is bounded by the worker's pool size and forgets least recently used leaves first, as
the worker's own tree does; a prefix the router still remembers is likely, not certain, to be
cached there. The worker shares a prefix only within one namespace (tenant, `cache_salt` and
adapter), so the tree answers "was this prefix sent here?" only within one too. No model, no
torch: plain lists of ints.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

# Namespaces one tree remembers at most: a client sending a new salt each time makes one each,
# and each costs a root and its salt's characters, so they are bounded apart from the tokens.
MAX_NAMESPACES = 4096


@dataclass(frozen=True)
class Namespace:
    """Where a worker shares prefixes: one tenant's requests under one `cache_salt` and one
    LoRA adapter (`lora_path`; "" for all three: the shared cache of the base model)."""

    tenant: str = ""
    cache_salt: str = ""
    lora_path: str = ""


DEFAULT_NAMESPACE = Namespace()


@dataclass(frozen=True)
class Prompt:
    """A prompt as routing sees it: its token ids and the namespace they may match in."""

    namespace: Namespace
    tokens: list[int]

    def extended(self, ids: list[int]) -> Prompt:
        return Prompt(self.namespace, self.tokens + ids)


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
    """Token prefixes per namespace, with LRU leaf eviction past `capacity` tokens in all.

    Contract: `match(prompt)` is the length of the longest prefix of `prompt.tokens` inserted
    under `prompt.namespace` and not since evicted: a prefix inserted under another namespace
    never counts (asking does not refresh it: only `insert`, the request really sent, does);
    `size` is the number of tokens held (each shared prefix counted once per namespace) and
    stays `<= capacity` after every `insert`. Leaves are evicted least recently inserted first
    whatever their namespace, as the worker's one pool does; a namespace left with no tokens is
    forgotten, and past `max_namespaces` the least recently inserted one is dropped whole.
    """

    def __init__(self, capacity: int, max_namespaces: int = MAX_NAMESPACES):
        if capacity < 1 or max_namespaces < 1:
            raise ValueError("capacity and max_namespaces must be >= 1")
        self.capacity, self.max_namespaces = capacity, max_namespaces
        self.roots: OrderedDict[Namespace, _Node] = OrderedDict()  # least recently inserted first
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, prompt: Prompt) -> int:
        tokens = prompt.tokens
        node, matched = self.roots.get(prompt.namespace), 0
        while node is not None and matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            common = _common_length(child.key, tokens[matched:])
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, prompt: Prompt) -> None:
        tokens = prompt.tokens
        if not tokens:
            return  # nothing to match later: no namespace made for it
        node, pos = self._root(prompt.namespace), 0
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
        self.roots.clear()
        self.size = 0

    def _root(self, namespace: Namespace) -> _Node:
        """`namespace`'s root, made if new (dropping the least recently inserted namespace
        when there are `max_namespaces` already), and marked the most recently inserted."""
        root = self.roots.get(namespace)
        if root is None:
            if len(self.roots) >= self.max_namespaces:
                _, oldest = self.roots.popitem(last=False)
                self.size -= _tokens_under(oldest)
            root = self.roots[namespace] = _Node([], None)
        self.roots.move_to_end(namespace)
        return root

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; return the new upper node."""
        assert child.parent is not None, "a root is never split"
        upper = _Node(child.key[:at], child.parent, last_access=child.last_access)
        child.parent.children[child.key[0]] = upper
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
                assert leaf.parent is not None, "a root is never a leaf"  # _leaves skips roots
                del leaf.parent.children[leaf.key[0]]
                self.size -= len(leaf.key)
        for namespace in [ns for ns, root in self.roots.items() if not root.children]:
            del self.roots[namespace]

    def _leaves(self) -> list[_Node]:
        stack = [child for root in self.roots.values() for child in root.children.values()]
        leaves = []
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def check(self) -> None:
        """Invariants: sizes add up, edges are non-empty and keyed by their first token, no
        namespace is empty, and there are at most `max_namespaces`."""
        assert len(self.roots) <= self.max_namespaces
        assert all(root.children for root in self.roots.values())
        total, stack = 0, list(self.roots.values())
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first and child.parent is node
                total += len(child.key)
                stack.append(child)
        assert total == self.size <= self.capacity, (total, self.size, self.capacity)


def _tokens_under(node: _Node) -> int:
    total, stack = 0, list(node.children.values())
    while stack:
        child = stack.pop()
        total += len(child.key)
        stack.extend(child.children.values())
    return total
