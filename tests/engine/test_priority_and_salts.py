"""Pure checks of cache salts in the tree and of priority ranks with aging (no model)."""

from __future__ import annotations

import time

import pytest
import torch

from radixrt.engine.request import Req, RequestScope
from radixrt.engine.schedule_policy import Ranking, order_waiting, preemption_victim
from radixrt.mem_cache.memory_pool import PageAllocator
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import pool_snapshot
from radixrt.sampling_params import SamplingParams

from ownership import assert_slot_ownership


def _tree() -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(64, 1, torch.device("cpu"))
    return alloc, RadixCache(1, alloc.free)


def test_a_prefix_is_matched_only_under_its_own_salt():
    alloc, tree = _tree()
    key = list(range(10, 30))
    tree.insert(key, alloc.alloc_extend(0, 0, len(key)).long(), salt="a")
    assert tree.match_prefix(key, "a").length == len(key)
    assert tree.match_prefix(key, "b").length == 0
    assert tree.match_prefix(key).length == 0
    for i in range(100):  # looking up salts nothing was cached under makes no roots
        tree.match_prefix(key, f"never-{i}")
    assert set(tree.roots) == {"", "a"}
    tree.insert(key[:8], alloc.alloc_extend(0, 0, 8).long(), salt="b")
    tree.check()
    no_requests = {
        "requests": [],
        "pinned_nodes": [],
        "rows": 0,
        "free_rows": 0,
        "running_rows": [],
    }
    assert_slot_ownership({**pool_snapshot(alloc, tree), **no_requests})
    assert tree.evict(100) == len(key) + 8  # one LRU over every salt's leaves
    assert set(tree.roots) == {""}, "emptied salted roots are dropped"
    tree.check()
    assert alloc.available() == alloc.total_tokens


def test_scope_salts_never_collide():
    salts = {
        RequestScope(tenant, salt).salt
        for tenant, salt in [("", ""), ("a", ""), ("", "a"), ("a", "b"), ("a:b", ""), ("a", ":b")]
    }
    assert len(salts) == 6 and "" in salts


def _req(name: str, priority: int, waited: float) -> Req:
    req = Req(name, [1, 2, 3], SamplingParams(), None, None, scope=RequestScope(priority=priority))
    req.arrival = time.monotonic() - waited
    return req


def test_priority_orders_first_and_aging_bounds_the_wait():
    _, tree = _tree()
    ranking = Ranking(aging_s=1.0)
    early_high, low, late_high = _req("e", 1, 2.05), _req("l", 0, 2.0), _req("h", 1, 0.4)
    order = order_waiting("lpm", [late_high, low, early_high], tree, ranking)
    assert [r.rid for r in order] == ["e", "l", "h"], "a low request passes highs 1 s younger"
    flipped = Ranking(low_values_first=True, aging_s=100.0)
    assert order_waiting("fcfs", [late_high, low], tree, flipped)[0] is low
    now = time.monotonic()
    assert preemption_victim([low], ranking.rank(late_high, now), ranking, now) is None
    fresh_low = _req("f", 0, 0.0)
    victim = preemption_victim([early_high, fresh_low], ranking.rank(late_high, now), ranking, now)
    assert victim is fresh_low


@pytest.mark.parametrize("fields", [{"priority": "high"}, {"timeout": 0}, {"cache_salt": 3}])
def test_bad_scope_fields_are_refused(fields):
    with pytest.raises(ValueError):
        RequestScope.from_fields("", fields)
