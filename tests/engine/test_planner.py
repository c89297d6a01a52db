"""The step planner without a model: a real slot manager over a CPU pool (built by
`build_slot_manager`), real requests, and a stand-in for the forward that only moves the
requests' KV lengths and appends tokens. Admission, chunking, retraction, priority preemption
and ordering are checked against the plan they return and the pool's ownership."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from radixrt.config import CacheSettings, ServerArgs
from radixrt.engine.budget import MIN_NEW_TOKEN_RATIO
from radixrt.engine.pins import PinBook, PinLimits
from radixrt.engine.planner import Accounts, PlannerHooks, StepPlan, StepPlanner
from radixrt.engine.request import Req, RequestScope
from radixrt.engine.schedule_policy import order_waiting
from radixrt.engine.stats import Counters, StepLog
from radixrt.engine.tenant_stats import TenantStats
from radixrt.mem_cache.memory_pool import PageAllocator, ReqToTokenPool, TokenToKVPool
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.mem_cache.tiers import DevicePool, build_slot_manager
from radixrt.protocol import ErrorCode, RequestError
from radixrt.sampling_params import SamplingParams

from ownership import assert_slot_ownership

CPU = torch.device("cpu")
NO_TIERS = CacheSettings()


def _kv(total_tokens: int, page_size: int = 1, rows: int = 8) -> KVSlotManager:
    allocator = PageAllocator(total_tokens, page_size, CPU)
    pool = TokenToKVPool(allocator.num_slots, 1, 1, 1, torch.float32, CPU)
    return build_slot_manager(
        DevicePool(allocator, ReqToTokenPool(rows, 128, CPU), pool), NO_TIERS, lambda: "none"
    )


class Loop:
    """A planner over `kv` with the scheduler's queues and finish, and a forward stand-in."""

    def __init__(self, kv: KVSlotManager, **overrides):
        args = ServerArgs(**{"max_total_tokens": kv.total_tokens, **overrides}).scheduler
        self.kv = kv
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.counters = Counters()
        limits = PinLimits.of(
            kv.total_tokens,
            args.max_pinned_fraction,
            args.max_pinned_tokens_per_client,
            args.max_pins_per_tenant,
        )
        self.pins = PinBook(kv, limits)
        hooks = PlannerHooks(lambda req: True, self.finish, self.pins.make_room)
        accounts = Accounts(self.counters, TenantStats(), StepLog(self.counters, kv, 40))
        self.planner = StepPlanner(args, kv, self.waiting, self.running, accounts, None, hooks)
        self.tokens = itertools.count(5000)

    def add(self, rid: str, prompt: list[int], new: int = 4, priority: int = 0) -> Req:
        params = SamplingParams(max_new_tokens=new, temperature=0)
        req = Req(rid, prompt, params, None, None, scope=RequestScope(priority=priority))
        self.waiting.append(req)
        return req

    def finish(self, req: Req) -> None:
        if req in self.running:
            self.kv.release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def step(self) -> StepPlan:
        """Plan a step, then do what the forward and the output processor do to memory."""
        plan = self.planner.schedule(StepPlan())
        for item in plan.items:
            req = item.req
            req.kv_len += item.n
            if item.n > 1 or not req.output_ids:
                self.kv.cache_unfinished(req)
            if req.tokens_to_compute == 0:
                token = next(self.tokens)
                req.output_ids.append(token)
                req.all_ids.append(token)
                if len(req.output_ids) >= req.params.max_new_tokens:
                    self.finish(req)
        self.kv.check(self.running)
        assert_slot_ownership(self.kv.snapshot(self.running, [r.rid for r in self.running]))
        return plan


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + seed] + torch.randint(2000, 9000, (n - 1,), generator=_gen(seed)).tolist()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_prompts_are_admitted_in_chunks_under_the_step_budget():
    loop = Loop(_kv(256), chunked_prefill_size=16)
    a, b = loop.add("a", _prompt(1, 40)), loop.add("b", _prompt(2, 10))
    plan = loop.step()
    assert [(s.req, s.n) for s in plan.items] == [(a, 16)], "one chunk, the budget's worth"
    assert [s.req for s in plan.admitted] == [a] and plan.allocated == {a: 16}
    plan = loop.step()
    assert [(s.req, s.n) for s in plan.items] == [(a, 16)], "a prefilling request goes first"
    plan = loop.step()
    assert [(s.req, s.n) for s in plan.items] == [(a, 8), (b, 8)]
    assert [s.req for s in plan.admitted] == [b]
    while loop.running or loop.waiting:
        loop.step()
    assert loop.counters.prompt_tokens_total == 50
    assert loop.kv.flush() and loop.kv.usage().free_tokens == 256


def test_a_short_pool_retracts_the_request_that_loses_least():
    loop = Loop(_kv(48), chunked_prefill_size=64)
    loop.planner.budget.new_token_ratio = MIN_NEW_TOKEN_RATIO  # reserve little: admit both
    first = loop.add("old", _prompt(3, 20), new=12)
    plans = [loop.step()]
    second = loop.add("new", _prompt(4, 20), new=12)
    plans += [loop.step() for _ in range(10)]
    assert [s.req for p in plans for s in p.admitted][:2] == [first, second]
    retracted = [r for p in plans for r in p.retracted]
    assert retracted, "two requests of 32 tokens cannot both fit in 48"
    assert retracted[0] is second, "the fewest generated tokens go first"
    assert second.num_preemptions == 1 and loop.counters.num_preemptions == len(retracted)
    assert not any(p.admitted for p in plans if p.retracted), "no admission right after"
    while loop.running or loop.waiting:
        loop.step()
    assert len(first.output_ids) == len(second.output_ids) == 12


def test_a_higher_priority_arrival_preempts_a_lower_running_one():
    loop = Loop(_kv(256), enable_priority_preemption=True, max_running_requests=1)
    low = loop.add("low", _prompt(5, 12), new=8, priority=0)
    loop.step()
    high = loop.add("high", _prompt(6, 12), new=2, priority=5)
    plan = loop.step()
    assert plan.preempted == [low] and not plan.retracted
    assert [s.req for s in plan.admitted] == [high] and loop.waiting == [low]
    assert loop.counters.priority_preemptions == 1


def _tree_state(kv: KVSlotManager) -> list[tuple]:
    return sorted(
        (n.id, tuple(n.key), n.last_access, n.lock_ref, n.parent.id)
        for n in kv.tree.all_nodes()
        if n.parent is not None
    )


def test_ordering_peeks_and_leaves_the_tree_untouched():
    """lpm and dfs-weight order by matches that split no node and touch no LRU time, and
    dfs-weight still groups matches that end part way into one node by their depth."""
    kv = _kv(256)
    loop = Loop(kv)
    shared, other = _prompt(7, 24), _prompt(8, 24)
    for i, p in enumerate([shared, other]):  # cache both prompts whole
        loop.add(f"warm{i}", p, new=1)
    while loop.running or loop.waiting:
        loop.step()
    before = _tree_state(kv)
    time.sleep(0.01)
    o1 = loop.add("o1", other + [1])
    s8 = loop.add("s8", shared[:8] + [2, 3])  # ends 8 tokens into the shared prompt's node
    s16 = loop.add("s16", shared[:16] + [4, 5])  # 16 tokens into it
    s16b = loop.add("s16b", shared[:16] + [6, 7])
    lpm = order_waiting("lpm", loop.waiting, kv)
    assert lpm[0] is o1 and lpm[-1] is s8, "longest cached prefix first"
    dfs = order_waiting("dfs-weight", loop.waiting, kv)
    assert dfs == [s8, s16, s16b, o1], "the heavier subtree first, shallow to deep"
    assert _tree_state(kv) == before, "ordering split a node or touched an LRU time"
    kv.match_prefix(s16.all_ids[:-1])
    assert _tree_state(kv) != before, "(a real match does split and touch)"


def _cached(loop: Loop, *prompts: list[int]) -> None:
    """Run each prompt to its end, so the tree holds it (what a pin needs)."""
    for k, prompt in enumerate(prompts):
        loop.add(f"warm-{k}-{prompt[0]}", prompt, new=1)
    while loop.running or loop.waiting:
        loop.step()


def test_pins_past_their_share_give_way_to_a_request_they_block():
    """Two owners' pins fill the pool (a budget of all of it); a third owner's request, which
    nothing running will ever make room for, gets it from the pins held past their owners'
    shares (the budget over the two owners plus the one asking), oldest first, and runs."""
    loop = Loop(_kv(256), max_pinned_fraction=1.0, chunked_prefill_size=512)
    a, b = _prompt(10, 110), _prompt(11, 110)
    _cached(loop, a, b)
    assert loop.pins.pin("a/1", a, "", "a") == 110 and loop.pins.pin("b/1", b, "", "b") == 110
    c = loop.add("c", _prompt(12, 120), new=4)
    loop.step()
    assert list(loop.kv.pins) == ["b/1"], "a's pin was over its share of 256 // 3 and older"
    while loop.running or loop.waiting:
        loop.step()
    assert len(c.output_ids) == 4 and c.finish_reason is None
    assert loop.kv.unpin("b/1") and loop.kv.flush() and loop.kv.usage().free_tokens == 256


def test_a_request_blocked_by_pins_within_their_shares_is_refused_overloaded():
    """One owner's pins, within its share, leave too little room for a request while nothing
    runs: the request ends at once with `overloaded` instead of waiting for ever; the pins stay."""
    loop = Loop(_kv(256), max_pinned_fraction=1.0, chunked_prefill_size=512)
    prefixes = [_prompt(20 + k, 30) for k in range(4)]
    _cached(loop, *prefixes)
    for k, prefix in enumerate(prefixes):
        loop.pins.pin(f"a/{k}", prefix, "", "a")
    big = loop.add("big", _prompt(30, 200), new=4)
    plan = loop.step()
    assert not plan.items and not loop.waiting and not loop.running
    assert big.finish_reason is not None and big.finish_reason.error == ErrorCode.OVERLOADED
    assert "--max-pinned-fraction" in (big.finish_reason.message or "")
    assert len(loop.kv.pins) == 4
    small = loop.add("small", _prompt(31, 60), new=2)
    while loop.running or loop.waiting:
        loop.step()
    assert len(small.output_ids) == 2, "what fits beside the pins runs"


def test_pins_share_one_budget_and_a_newcomer_gets_its_share():
    """The budget (--max-pinned-fraction of the pool) bounds all pins together: a pin past it
    releases other owners' pins held past their shares, oldest first, and is refused
    (`rate_limited`, nothing left pinned) when every other owner is within its share."""
    loop = Loop(_kv(256), max_pinned_fraction=0.5)  # 128 tokens of pins in all
    prefixes = [_prompt(40 + k, 40) for k in range(6)]
    _cached(loop, *prefixes)
    for k in range(3):
        loop.pins.pin(f"a/{k}", prefixes[k], "", "a")  # 120 of 128: a alone may hold it
    loop.pins.pin("b/0", prefixes[3], "", "b")  # 160 > 128, and a's 120 is past its share, 64
    assert list(loop.kv.pins) == ["a/1", "a/2", "b/0"]
    loop.pins.pin("b/1", prefixes[4], "", "b")  # 160 again: a's 80 is still past 64
    assert list(loop.kv.pins) == ["a/2", "b/0", "b/1"]
    with pytest.raises(RequestError) as refused:
        loop.pins.pin("b/2", prefixes[5], "", "b")  # a's 40 is within its share: b is refused
    assert refused.value.code == ErrorCode.RATE_LIMITED
    assert "--max-pinned-fraction" in str(refused.value)
    assert list(loop.kv.pins) == ["a/2", "b/0", "b/1"]
