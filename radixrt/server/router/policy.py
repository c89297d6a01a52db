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
from typing import Generic, Protocol, TypeVar

from radixrt.config import ROUTER_POLICIES, RouterSettings
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


W = TypeVar("W", bound=WorkerView)  # the router's own worker type: a route names one it gave


@dataclass(frozen=True)
class Route(Generic[W]):
    worker: W
    reason: RouteReason
    matched: int = 0  # tokens the chosen worker is believed to hold


def _least_loaded(workers: list[W]) -> W:
    """Fewest sequences; on a tie the emptier tree (more room), then the lower index."""
    return min(workers, key=lambda w: (w.load, w.tree.size, w.index))


class CacheAwarePolicy:
    name = "cache-aware"

    def __init__(self, settings: RouterSettings | None = None):
        """`settings`' thresholds (`RouterSettings` says why their defaults), else the defaults."""
        self.settings = settings or RouterSettings()

    def choose(self, prompt: Prompt, workers: list[W]) -> Route[W]:
        t = self.settings
        loads = [w.load for w in workers]
        if max(loads) - min(loads) > t.router_balance_abs_threshold and max(loads) > min(loads) * (
            t.router_balance_rel_threshold
        ):
            return Route(_least_loaded(workers), RouteReason.LOAD)
        matches = [(w.tree.match(prompt), -w.load, -w.index, w) for w in workers]
        matched, _, _, best = max(matches, key=lambda m: m[:3])
        if matched > 0 and matched >= t.router_cache_threshold * len(prompt.tokens):
            return Route(best, RouteReason.MATCH, matched)
        worker = _least_loaded(workers)
        return Route(worker, RouteReason.LOAD, worker.tree.match(prompt))


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prompt: Prompt, workers: list[W]) -> Route[W]:
        return Route(workers[next(self._turn) % len(workers)], RouteReason.ROUND_ROBIN)


class ShortestQueuePolicy:
    name = "shortest-queue"

    def choose(self, prompt: Prompt, workers: list[W]) -> Route[W]:
        return Route(_least_loaded(workers), RouteReason.LOAD)


Policy = CacheAwarePolicy | RoundRobinPolicy | ShortestQueuePolicy


def make_policy(settings: RouterSettings) -> Policy:
    """The policy `settings.router_policy` names, with `settings`' thresholds."""
    name = settings.router_policy
    if name == "cache-aware":
        return CacheAwarePolicy(settings)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "shortest-queue":
        return ShortestQueuePolicy()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(ROUTER_POLICIES)}")
