"""The router's approximate prefix tree and routing rules, with plain numbers (no sockets)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.server.router.policy import (
    CacheAwarePolicy,
    CacheAwareThresholds,
    RoundRobinPolicy,
    RouteReason,
    ShortestQueuePolicy,
    make_policy,
)
from radixrt.server.router.prefix_tree import ApproxPrefixTree


@dataclass
class FakeWorker:
    """A worker as a policy sees it: an index, a load and a tree (the real tree)."""

    index: int
    load: int = 0
    tree: ApproxPrefixTree = field(default_factory=lambda: ApproxPrefixTree(10_000))


def test_tree_matches_inserted_prefixes_and_splits():
    tree = ApproxPrefixTree(100)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5])
    assert tree.match([1, 2, 3, 4, 9]) == 4
    assert tree.match([1, 2, 5, 6]) == 3
    assert tree.match([1, 7]) == 1
    assert tree.match([8]) == 0
    assert tree.size == 5  # 1 2 shared once, then 3 4 and 5
    tree.check()


def test_tree_evicts_least_recently_inserted_leaves_first():
    tree = ApproxPrefixTree(10)
    tree.insert([1] * 4)
    tree.insert([2] * 4)
    tree.insert([1] * 4)  # refreshes the first
    tree.insert([3] * 4)  # over capacity: [2]*4 is the oldest leaf
    tree.check()
    assert tree.match([2] * 4) == 0
    assert tree.match([1] * 4) == 4 and tree.match([3] * 4) == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=40))
def test_tree_invariants_under_random_inserts(seqs):
    tree = ApproxPrefixTree(30)
    for seq in seqs:
        tree.insert(seq)
        tree.check()
        if len(seq) <= 27:  # what was just inserted survives its own eviction
            assert tree.match(seq) == len(seq)


def test_cache_aware_follows_the_longest_match_above_the_threshold():
    workers = [FakeWorker(0), FakeWorker(1)]
    history = list(range(100))
    workers[1].tree.insert(history)
    policy = CacheAwarePolicy()
    route = policy.choose(history + [7, 8, 9], workers)
    assert route.worker is workers[1] and route.reason is RouteReason.MATCH
    assert route.matched == 100
    # a prompt the match covers less than half of goes by load
    workers[1].load = 3
    route = policy.choose(history[:10] + list(range(500, 520)), workers)
    assert route.worker is workers[0] and route.reason is RouteReason.LOAD


def test_cache_aware_sends_to_the_idlest_when_load_is_out_of_balance():
    workers = [FakeWorker(0, load=40), FakeWorker(1, load=10)]
    workers[0].tree.insert(list(range(50)))
    route = CacheAwarePolicy().choose(list(range(50)), workers)
    assert route.worker is workers[1] and route.reason is RouteReason.LOAD
    # both thresholds must hold: 40 against 30 is over the absolute gap but not 1.5x
    workers[1].load = 30
    thresholds = CacheAwareThresholds(balance_abs_threshold=5, balance_rel_threshold=1.5)
    route = CacheAwarePolicy(thresholds).choose(list(range(50)), workers)
    assert route.worker is workers[0] and route.reason is RouteReason.MATCH


def test_round_robin_and_shortest_queue():
    workers = [FakeWorker(0, load=5), FakeWorker(1, load=1), FakeWorker(2, load=3)]
    rr = RoundRobinPolicy()
    assert [rr.choose([1], workers).worker.index for _ in range(4)] == [0, 1, 2, 0]
    assert ShortestQueuePolicy().choose([1], workers).worker is workers[1]


def test_policy_names_and_thresholds_are_checked():
    assert make_policy("round-robin").name == "round-robin"
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        CacheAwareThresholds(cache_threshold=2)


def test_shared_system_prompts_spread_over_workers_and_stick():
    """K system prompts x questions, arriving one by one: each prompt's questions stay on the
    worker that first got it, and the prompts spread over both workers."""
    rng = random.Random(0)
    workers = [FakeWorker(0), FakeWorker(1)]
    prompts = [[rng.randrange(1000) for _ in range(50)] for _ in range(4)]
    policy, home = CacheAwarePolicy(), {}
    for i in range(40):
        k = i % 4
        tokens = prompts[k] + [rng.randrange(1000) for _ in range(5)]
        route = policy.choose(tokens, workers)
        route.worker.tree.insert(tokens)
        route.worker.load += 1
        home.setdefault(k, route.worker.index)
        assert route.worker.index == home[k]
    assert set(home.values()) == {0, 1}
