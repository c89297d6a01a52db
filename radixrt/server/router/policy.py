"""Where the router sends a request: cache-aware, round-robin or shortest-queue.

A policy sees a `Prompt` (its tokens and cache namespace) and each live worker as a `WorkerView`
(its load and its approximate prefix tree), and returns a `Route`: the worker and why it was
chosen, which the router counts in `stats()`. A match is only ever within the prompt's namespace.
No sockets here, so every rule is testable with plain numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from radixrt.config import (
    ROUTER_BALANCE_ABS_THRESHOLD,
    ROUTER_BALANCE_REL_THRESHOLD,
    ROUTER_CACHE_THRESHOLD,
)
from radixrt.server.router.prefix_tree import ApproxPrefixTree, Prompt


class RouteReason(str, Enum):
    MATCH = "match"  # the longest cached prefix, above the threshold
    LOAD = "load"  # the least loaded worker: no match good enough, or load out of balance
    ROUND_ROBIN = "round_robin"
    PIN = "pin"  # the request extends a prefix its client pinned (a fork's branches)


class WorkerView(Protocol):
    index: int
    load: int  # sequences in flight there, as the router counts them
    tree: ApproxPrefixTree


@dataclass(frozen=True)
class Route:
    worker: WorkerView
    reason: RouteReason
    matched: int = 0  # tokens the chosen worker is believed to hold


@dataclass(frozen=True)
class CacheAwareThresholds:
    """SGLang's router rules, with defaults sized for small CPU fleets.

    - `cache_threshold` (0.5): route by match only when the match covers at least this share of
      the prompt; below it the prefix is too short to be worth a queue, so load decides. Half
      keeps a conversation's next turn (its history is most of its prompt) and a system prompt
      shared by questions on their worker, and lets short unrelated prompts spread.
    - `balance_abs_threshold` (4) and `balance_rel_threshold` (1.25): when the busiest worker has
      both more than 4 sequences more and more than 1.25x as many as the idlest, the idlest gets
      the request whatever the match. Both must hold: a gap of a few sequences is noise at any
      load, and 2 against 3 is no imbalance. They are low because a CPU worker's decode step
      grows with its batch (it is compute-bound), so a worker with twice the sequences takes
      about twice as long a token; on `make bench-dp`'s 16 clients over two workers, 16 and 1.5
      (closer to SGLang's GPU defaults) kept the hit rate but cost 11% of the throughput of
      round-robin, 4 and 1.25 gained 26%. On GPUs, whose step time barely grows with the batch,
      raise them.
    """

    cache_threshold: float = ROUTER_CACHE_THRESHOLD
    balance_abs_threshold: int = ROUTER_BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = ROUTER_BALANCE_REL_THRESHOLD

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1")


def _least_loaded(workers: list[WorkerView]) -> WorkerView:
    """Fewest sequences; on a tie the emptier tree (more room), then the lower index."""
    return min(workers, key=lambda w: (w.load, w.tree.size, w.index))


class CacheAwarePolicy:
    name = "cache-aware"

    def __init__(self, thresholds: CacheAwareThresholds | None = None):
        self.thresholds = thresholds or CacheAwareThresholds()

    def choose(self, prompt: Prompt, workers: list[WorkerView]) -> Route:
        t = self.thresholds
        loads = [w.load for w in workers]
        if max(loads) - min(loads) > t.balance_abs_threshold and max(loads) > min(loads) * (
            t.balance_rel_threshold
        ):
            return Route(_least_loaded(workers), RouteReason.LOAD)
        matches = [(w.tree.match(prompt), -w.load, -w.index, w) for w in workers]
        matched, _, _, best = max(matches, key=lambda m: m[:3])
        if matched > 0 and matched >= t.cache_threshold * len(prompt.tokens):
            return Route(best, RouteReason.MATCH, matched)
        worker = _least_loaded(workers)
        return Route(worker, RouteReason.LOAD, worker.tree.match(prompt))


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prompt: Prompt, workers: list[WorkerView]) -> Route:
        return Route(workers[next(self._turn) % len(workers)], RouteReason.ROUND_ROBIN)


class ShortestQueuePolicy:
    name = "shortest-queue"

    def choose(self, prompt: Prompt, workers: list[WorkerView]) -> Route:
        return Route(_least_loaded(workers), RouteReason.LOAD)


POLICIES = ("cache-aware", "round-robin", "shortest-queue")


def make_policy(name: str, thresholds: CacheAwareThresholds | None = None):
    if name == "cache-aware":
        return CacheAwarePolicy(thresholds)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "shortest-queue":
        return ShortestQueuePolicy()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
