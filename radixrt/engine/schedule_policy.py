"""Order in which waiting requests are offered admission, and which running ones give way.

Priority comes first, the cache policy second: waiting requests are offered admission by rank,
then in the policy's order within a rank. A request's rank is its priority (negated with
`low_values_first`) plus one per `aging_s` seconds since it arrived, so a request of priority p
ranks level with a request of priority p + k that arrived k * aging_s seconds after it: it is
offered admission before, and never retracted for, any request of priority at most p + k that
arrives k * aging_s seconds or more after it. That bounds starvation by arrivals; its running
time then depends only on the requests ahead of it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from radixrt.engine.request import Req
from radixrt.mem_cache.radix_cache import PrefixPeek, TreeNode

LPM_FALLBACK_QUEUE_LEN = 128  # past this, matching every waiting request costs more than it saves
AGING_TOKENS_PER_SECOND = 256  # a request waiting 1 s ranks as if 256 more tokens were cached


def match_key(req: Req) -> list[int]:
    """The prefix a request may take from the cache: at least one token must still be computed,
    and prompt logprobs need hidden states from `logprob_start_len` on (mean pooling, from the
    first position)."""
    end = len(req.all_ids) - 1
    if req.wants_prompt_logprobs():
        end = min(end, req.params.logprob_start_len)
    if req.pooling is not None and req.pooling.mode == "mean":
        end = 0
    return req.all_ids[:end]


@dataclass(frozen=True)
class Ranking:
    """How requests rank (see the module docstring): higher ranks run first."""

    low_values_first: bool = False
    aging_s: float = 10.0

    def base(self, req: Req) -> int:
        return -req.priority if self.low_values_first else req.priority

    def rank(self, req: Req, now: float) -> int:
        return self.base(req) + int((now - req.arrival) // self.aging_s)


DEFAULT_RANKING = Ranking()


class PrefixView(Protocol):
    """What ordering reads of the cache (`KVSlotManager` is one): matches that change nothing."""

    @property
    def sharing(self) -> bool: ...

    def peek_prefix(self, key: list[int], salt: str = "") -> PrefixPeek: ...


def order_waiting(
    policy: str, waiting: list[Req], cache: PrefixView, ranking: Ranking = DEFAULT_RANKING
) -> list[Req]:
    """Waiting requests by rank, then in the cache policy's order (a stable sort keeps it).
    The cache is only peeked at: ordering splits no node and touches no LRU time."""
    now = time.monotonic()
    return sorted(_policy_order(policy, waiting, cache), key=lambda r: -ranking.rank(r, now))


def _policy_order(policy: str, waiting: list[Req], cache: PrefixView) -> list[Req]:
    if policy == "fcfs" or len(waiting) > LPM_FALLBACK_QUEUE_LEN or not cache.sharing:
        return list(waiting)
    matches = {id(r): cache.peek_prefix(match_key(r), r.cache_salt) for r in waiting}
    if policy == "lpm":
        now = time.monotonic()
        return sorted(
            waiting,
            key=lambda r: -(matches[id(r)].length + AGING_TOKENS_PER_SECOND * (now - r.arrival)),
        )
    if policy == "dfs-weight":
        return _dfs_weight(waiting, matches)
    raise ValueError(f"unknown schedule policy {policy!r}")


Point = tuple[TreeNode, int]  # a place in the tree: a node and how many of its tokens


def _dfs_weight(waiting: list[Req], matches: dict[int, PrefixPeek]) -> list[Req]:
    """Walk the tree depth first, heaviest subtree (most waiting requests) first, so requests
    that share a prefix run back to back while it is cached; one salt's root after another.

    A match that ends part way into a node is a point of its own between the node's parent and
    the node (where `match_prefix` would split it), below any shallower point in that node."""
    depths: dict[TreeNode, set[int]] = defaultdict(set)
    for m in matches.values():
        depths[m.node].add(m.into)

    def up(point: Point) -> Point:
        node, into = point
        shallower = [d for d in depths[node] if d < into]
        if shallower:
            return node, max(shallower)
        parent = node.up()
        return parent, len(parent.key)

    at_point: dict[Point, list[Req]] = defaultdict(list)
    weight: dict[Point, int] = defaultdict(int)
    children: dict[Point, set[Point]] = defaultdict(set)
    roots: dict[Point, None] = {}  # in the order their first request waits
    for req in waiting:
        m = matches[id(req)]
        point = (m.node, m.into)
        at_point[point].append(req)
        while point[0].parent is not None:
            weight[point] += 1
            parent = up(point)
            children[parent].add(point)
            point = parent
        roots[point] = None
    order: list[Req] = []
    stack = list(reversed(roots))
    while stack:
        point = stack.pop()
        order.extend(at_point[point])
        stack.extend(sorted(children[point], key=lambda p: weight[p]))  # heaviest popped first
    return order


def pick_victim(candidates: list[Req], ranking: Ranking = DEFAULT_RANKING) -> Req | None:
    """The running request whose retraction loses least: the lowest priority, then the fewest
    generated tokens, then the longest prompt (most of it comes back from the cache). None when
    there is no other choice."""
    if len(candidates) <= 1:
        return None
    return min(candidates, key=lambda r: (ranking.base(r), len(r.output_ids), -len(r.input_ids)))


def preemption_victim(running: list[Req], rank: int, ranking: Ranking, now: float) -> Req | None:
    """The running request to retract for a waiting one of `rank`: among those ranked below it,
    the lowest ranked, then as `pick_victim`; None when none ranks below."""
    below = [r for r in running if ranking.rank(r, now) < rank]
    if not below:
        return None
    return min(below, key=lambda r: (ranking.rank(r, now), len(r.output_ids), -len(r.input_ids)))
