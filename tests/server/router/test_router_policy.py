"""The router's approximate prefix trees (one per cache namespace) and routing rules, with plain
numbers (no sockets)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.config import ROUTER_POLICIES, RouterSettings
from radixrt.server.router.policy import (
    CacheAwarePolicy,
    RoundRobinPolicy,
    RouteReason,
    ShortestQueuePolicy,
    make_policy,
)
from radixrt.server.router.prefix_tree import (
    DEFAULT_NAMESPACE,
    ApproxPrefixTree,
    Namespace,
    Prompt,
)
from radixrt.server.router.router import namespace_of
from radixrt.server.tenants import DEFAULT_TENANT


def prompt(tokens, namespace: Namespace = DEFAULT_NAMESPACE) -> Prompt:
    """`tokens` (any iterable of ints) as a prompt in `namespace`."""
    return Prompt(namespace, list(tokens))


@dataclass
class FakeWorker:
    """A worker as a policy sees it: an index, a load and a tree (the real tree)."""

    index: int
    load: int = 0
    tree: ApproxPrefixTree = field(default_factory=lambda: ApproxPrefixTree(10_000))


def test_tree_matches_inserted_prefixes_and_splits():
    tree = ApproxPrefixTree(100)
    tree.insert(prompt([1, 2, 3, 4]))
    tree.insert(prompt([1, 2, 5]))
    assert tree.match(prompt([1, 2, 3, 4, 9])) == 4
    assert tree.match(prompt([1, 2, 5, 6])) == 3
    assert tree.match(prompt([1, 7])) == 1
    assert tree.match(prompt([8])) == 0
    assert tree.size == 5  # 1 2 shared once, then 3 4 and 5
    tree.check()


def test_tree_evicts_least_recently_inserted_leaves_first():
    tree = ApproxPrefixTree(10)
    tree.insert(prompt([1] * 4))
    tree.insert(prompt([2] * 4))
    tree.insert(prompt([1] * 4))  # refreshes the first
    tree.insert(prompt([3] * 4))  # over capacity: [2]*4 is the oldest leaf
    tree.check()
    assert tree.match(prompt([2] * 4)) == 0
    assert tree.match(prompt([1] * 4)) == 4 and tree.match(prompt([3] * 4)) == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=40))
def test_tree_invariants_under_random_inserts(seqs):
    tree = ApproxPrefixTree(30)
    for seq in seqs:
        tree.insert(prompt(seq))
        tree.check()
        if len(seq) <= 27:  # what was just inserted survives its own eviction
            assert tree.match(prompt(seq)) == len(seq)


def test_cache_aware_follows_the_longest_match_above_the_threshold():
    workers = [FakeWorker(0), FakeWorker(1)]
    history = list(range(100))
    workers[1].tree.insert(prompt(history))
    policy = CacheAwarePolicy()
    route = policy.choose(prompt(history + [7, 8, 9]), workers)
    assert route.worker is workers[1] and route.reason is RouteReason.MATCH
    assert route.matched == 100
    # a prompt the match covers less than half of goes by load
    workers[1].load = 3
    route = policy.choose(prompt(history[:10] + list(range(500, 520))), workers)
    assert route.worker is workers[0] and route.reason is RouteReason.LOAD


def test_cache_aware_sends_to_the_idlest_when_load_is_out_of_balance():
    workers = [FakeWorker(0, load=40), FakeWorker(1, load=10)]
    workers[0].tree.insert(prompt(range(50)))
    route = CacheAwarePolicy().choose(prompt(range(50)), workers)
    assert route.worker is workers[1] and route.reason is RouteReason.LOAD
    # both thresholds must hold: 40 against 30 is over the absolute gap but not 1.5x
    workers[1].load = 30
    settings = replace(
        RouterSettings(), router_balance_abs_threshold=5, router_balance_rel_threshold=1.5
    )
    route = CacheAwarePolicy(settings).choose(prompt(range(50)), workers)
    assert route.worker is workers[0] and route.reason is RouteReason.MATCH


def test_round_robin_and_shortest_queue():
    workers = [FakeWorker(0, load=5), FakeWorker(1, load=1), FakeWorker(2, load=3)]
    rr = RoundRobinPolicy()
    assert [rr.choose(prompt([1]), workers).worker.index for _ in range(4)] == [0, 1, 2, 0]
    assert ShortestQueuePolicy().choose(prompt([1]), workers).worker is workers[1]


def test_policy_names_and_thresholds_are_checked():
    defaults = RouterSettings()
    for name in ROUTER_POLICIES:  # each name the setting takes is a policy
        assert make_policy(replace(defaults, router_policy=name)).name == name
    with pytest.raises(ValueError, match="router_policy must be one of"):
        replace(defaults, router_policy="random")
    with pytest.raises(ValueError, match="router_cache_threshold"):
        replace(defaults, router_cache_threshold=2)


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
        route = policy.choose(prompt(tokens), workers)
        route.worker.tree.insert(prompt(tokens))
        route.worker.load += 1
        home.setdefault(k, route.worker.index)
        assert route.worker.index == home[k]
    assert set(home.values()) == {0, 1}


SALTS = [Namespace(DEFAULT_TENANT, salt) for salt in ("", "a", "b")]


def test_a_prefix_matches_only_in_the_namespace_it_was_inserted_in():
    tree = ApproxPrefixTree(100)
    a, b = SALTS[1], SALTS[2]
    tree.insert(prompt([1, 2, 3, 4], a))
    assert tree.match(prompt([1, 2, 3, 4], a)) == 4
    assert tree.match(prompt([1, 2, 3, 4], b)) == 0
    assert tree.match(prompt([1, 2, 3, 4])) == 0
    assert tree.match(prompt([1, 2, 3, 4], Namespace("alice", "a"))) == 0  # another tenant's salt
    tree.insert(prompt([1, 2, 9], b))
    assert tree.size == 7 and len(tree.roots) == 2  # no sharing across namespaces
    tree.insert(prompt([]))  # an empty prompt makes no namespace
    assert len(tree.roots) == 2
    tree.check()


def test_eviction_is_lru_across_namespaces_and_forgets_empty_ones():
    tree = ApproxPrefixTree(10)
    tree.insert(prompt([1] * 4, SALTS[1]))
    tree.insert(prompt([2] * 4, SALTS[2]))
    tree.insert(prompt([3] * 4, SALTS[0]))  # over capacity: salt a's leaf is the oldest
    tree.check()
    assert tree.match(prompt([1] * 4, SALTS[1])) == 0 and SALTS[1] not in tree.roots
    assert tree.match(prompt([2] * 4, SALTS[2])) == 4 and tree.match(prompt([3] * 4)) == 4


def test_a_new_salt_each_time_cannot_grow_the_tree_past_its_namespace_bound():
    tree = ApproxPrefixTree(1 << 20, max_namespaces=8)
    for i in range(100):
        tree.insert(prompt([1, 2, 3], Namespace(DEFAULT_TENANT, f"salt-{i}")))
        tree.check()
    assert len(tree.roots) == 8 and tree.size == 8 * 3
    assert tree.match(prompt([1, 2, 3], Namespace(DEFAULT_TENANT, "salt-99"))) == 3
    assert tree.match(prompt([1, 2, 3], Namespace(DEFAULT_TENANT, "salt-0"))) == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(SALTS), st.lists(st.integers(0, 4), min_size=1, max_size=12)),
        min_size=1,
        max_size=40,
    )
)
def test_namespaced_tree_invariants_and_no_match_across_namespaces(inserts):
    """Whatever is inserted, a match never exceeds what that namespace alone was given."""
    tree = ApproxPrefixTree(30, max_namespaces=2)
    alone = {ns: ApproxPrefixTree(10_000) for ns in SALTS}  # unbounded, one per namespace
    for namespace, seq in inserts:
        tree.insert(prompt(seq, namespace))
        alone[namespace].insert(prompt(seq, namespace))
        tree.check()
        for other in SALTS:
            for _, probe in inserts:
                assert tree.match(prompt(probe, other)) <= alone[other].match(prompt(probe, other))


def test_cache_aware_never_routes_by_a_match_in_another_namespace():
    workers = [FakeWorker(0), FakeWorker(1)]
    history = list(range(100))
    workers[1].tree.insert(prompt(history, SALTS[1]))
    policy = CacheAwarePolicy()
    same = policy.choose(prompt(history + [7], SALTS[1]), workers)
    assert same.worker is workers[1] and same.reason is RouteReason.MATCH
    other = policy.choose(prompt(history + [7], SALTS[2]), workers)
    assert other.reason is RouteReason.LOAD and other.matched == 0
    assert other.worker is workers[0]  # on a tie in load, the emptier tree


def test_namespace_of_reads_the_salt_and_refuses_a_bad_one():
    assert namespace_of(DEFAULT_TENANT, {}) == DEFAULT_NAMESPACE
    assert namespace_of("alice", {"cache_salt": "s"}) == Namespace("alice", "s")
    assert namespace_of(DEFAULT_TENANT, {"cache_salt": None}) == DEFAULT_NAMESPACE
    for bad in (5, ["s"], "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            namespace_of(DEFAULT_TENANT, {"cache_salt": bad})
