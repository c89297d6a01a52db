"""The Scheduler driven in-process on the tiny model: retraction, pool-size aborts, unchunked
prefill and the admission order of each policy, with the pool's bookkeeping checked after
every step and everything freed at the end (invariants 1 and 2)."""

from __future__ import annotations

import time

import pytest
import torch

from radixrt.engine.request import Req
from radixrt.engine.schedule_policy import AGING_TOKENS_PER_SECOND, order_waiting
from radixrt.engine.scheduler import Scheduler
from radixrt.sampling_params import SamplingParams

from helpers import drain, hf_greedy, make_scheduler
from ownership import assert_no_leak, check_scheduler

# far more than any test here needs; a scheduler that stops progressing fails instead of hanging
MAX_STEPS = 400


def _prompt(seed: int, n: int) -> list[int]:
    """n token ids, distinct per seed from the first token on (so nothing is shared by accident)."""
    gen = torch.Generator().manual_seed(seed)
    return [1000 + seed] + torch.randint(2000, 40000, (n - 1,), generator=gen).tolist()


def _scheduler(model_dir, **overrides) -> Scheduler:
    return make_scheduler(model_dir, **{"max_total_tokens": 256, **overrides})


def _params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams.from_dict(
        {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    )


def _submit(
    scheduler: Scheduler, prompts: list[list[int]], max_new_tokens: int, tag: str = "r"
) -> list[Req]:
    reqs = [
        scheduler.make_request(f"{tag}{i}", p, _params(max_new_tokens))
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.add_request(req)
    return reqs


def _drain(scheduler: Scheduler) -> list[Req]:
    """Step until nothing is left, checking the bookkeeping after every step; returns every
    request step() reported, in the order it reported them."""
    return drain(scheduler, check_scheduler)


def _finish_reason(req: Req) -> dict:
    return req.meta_info()["finish_reason"]


# ---- a: retraction with pages of 4 ---------------------------------------------------------------
def test_retraction_with_pages_matches_transformers(tiny_model_dir):
    """Four requests needing 9 pages each share a 16-page pool: some are retracted and recomputed,
    yet every greedy output equals transformers', and the pool's bookkeeping holds at every step."""
    prompts = [_prompt(i, n) for i, n in enumerate([5, 6, 7, 9])]
    max_new = 30
    scheduler = _scheduler(tiny_model_dir, page_size=4, max_total_tokens=64)
    reqs = _submit(scheduler, prompts, max_new)
    _drain(scheduler)

    assert scheduler.stats()["num_preemptions"] > 0
    assert any(r.num_preemptions for r in reqs)
    assert [r.output_ids for r in reqs] == hf_greedy(tiny_model_dir, prompts, max_new)
    assert all(_finish_reason(r)["type"] == "length" for r in reqs)
    assert_no_leak(scheduler)


# ---- b: requests the pool can never hold -------------------------------------------------------
@pytest.mark.parametrize("big_first", [True, False], ids=["big-first", "big-last"])
def test_request_larger_than_pool_aborts_alone(tiny_model_dir, big_first):
    """A prompt that fits but whose output cannot (prompt + max_new_tokens > pool) ends with an
    abort and a message, reported by step(); the requests around it finish as transformers'."""
    scheduler = _scheduler(tiny_model_dir, page_size=4, max_total_tokens=32)
    small = [_prompt(1, 5), _prompt(2, 6)]
    if big_first:
        big = _submit(scheduler, [_prompt(3, 30)], 10, tag="big")[0]
    reqs = _submit(scheduler, small, 6)
    if not big_first:
        big = _submit(scheduler, [_prompt(3, 30)], 10, tag="big")[0]
    reported = _drain(scheduler)

    reason = _finish_reason(big)
    assert reason["type"] == "abort" and "cannot hold" in reason["message"]
    assert len(big.output_ids) < 10
    assert big in reported
    assert [r.output_ids for r in reqs] == hf_greedy(tiny_model_dir, small, 6)
    assert all(_finish_reason(r)["type"] == "length" for r in reqs)
    assert_no_leak(scheduler)


def test_prompt_as_large_as_pool_is_refused(tiny_model_dir):
    """make_request refuses a prompt of pool size or more with a ValueError that names the pool;
    one token less is accepted."""
    scheduler = _scheduler(tiny_model_dir, page_size=4, max_total_tokens=32)
    for n in (32, 33):
        with pytest.raises(ValueError, match="pool 32"):
            scheduler.make_request("too-long", _prompt(4, n), _params(1))
    req = scheduler.make_request("fits", _prompt(4, 31), _params(1))
    scheduler.add_request(req)
    _drain(scheduler)
    assert _finish_reason(req)["type"] == "length" and len(req.output_ids) == 1
    assert not scheduler.waiting and not scheduler.running
    assert_no_leak(scheduler)


# ---- c: chunking off --------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, -1])
def test_unchunked_prefill_matches_transformers(tiny_model_dir, monkeypatch, chunk):
    """With chunking off every prompt is prefilled in one piece; one longer than max_prefill_tokens
    still runs, in a step of its own; outputs equal transformers'."""
    scheduler = _scheduler(tiny_model_dir, chunked_prefill_size=chunk, max_prefill_tokens=16)
    steps = []
    forward = scheduler.runner.forward

    def recording_forward(batch):
        steps.append(list(batch.extend_lens))
        return forward(batch)

    monkeypatch.setattr(scheduler.runner, "forward", recording_forward)
    lens = [9, 30, 6, 12, 25]
    prompts = [_prompt(10 + i, n) for i, n in enumerate(lens)]
    reqs = _submit(scheduler, prompts, 5)
    _drain(scheduler)

    assert [r.output_ids for r in reqs] == hf_greedy(tiny_model_dir, prompts, 5)
    prefills = [e for step in steps for e in step if e > 1]
    assert sorted(prefills) == sorted(lens), "a prompt was split into chunks"
    for n in (30, 25):
        assert [n] in steps, f"the {n}-token prompt did not run alone"
    for step in steps:
        if len(step) > 1:
            assert sum(e for e in step if e > 1) <= 16, (
                f"step {step} prefilled more than max_prefill_tokens"
            )
    assert_no_leak(scheduler)


# ---- d: admission order of the policies ----------------------------------------------------
SHARED = _prompt(20, 40)


def _warm(scheduler: Scheduler, *prefixes: list[int]) -> None:
    """Cache each prefix in the tree by running it to the end."""
    _submit(scheduler, list(prefixes), 1, tag="warm")
    _drain(scheduler)
    assert scheduler.stats()["cached_tokens"] >= sum(len(p) for p in prefixes)


def _admitted_first(scheduler: Scheduler) -> Req:
    """The one request admitted by the next step (max_running_requests=1)."""
    scheduler.step()
    check_scheduler(scheduler)
    assert len(scheduler.running) == 1
    return scheduler.running[0]


def _same_arrival(reqs: list[Req], now: float) -> None:
    for req in reqs:
        req.arrival = now


def test_lpm_admits_longest_cached_prefix_first(tiny_model_dir):
    """lpm admits the request with the longest cached prefix before an earlier, unmatched one."""
    scheduler = _scheduler(tiny_model_dir, schedule_policy="lpm", max_running_requests=1)
    _warm(scheduler, SHARED)
    cold, hot = _submit(scheduler, [_prompt(21, 12), SHARED + [50, 51, 52]], 3)
    _same_arrival([cold, hot], time.monotonic())
    assert _admitted_first(scheduler) is hot
    assert hot.cached_tokens == len(SHARED)
    _drain(scheduler)
    assert_no_leak(scheduler)


def test_lpm_aging_admits_a_long_waiter_first(tiny_model_dir):
    """lpm ages: a request that has waited long enough outranks a better-matching newcomer."""
    scheduler = _scheduler(tiny_model_dir, schedule_policy="lpm", max_running_requests=1)
    _warm(scheduler, SHARED)
    cold, hot = _submit(scheduler, [_prompt(22, 12), SHARED + [50, 51, 52]], 3)
    now = time.monotonic()
    hot.arrival = now
    # worth 4x the hot request's match
    cold.arrival = now - 4 * len(SHARED) / AGING_TOKENS_PER_SECOND
    assert _admitted_first(scheduler) is cold
    _drain(scheduler)
    assert_no_leak(scheduler)


def test_fcfs_keeps_arrival_order(tiny_model_dir):
    """fcfs admits in arrival order even when a later request has its whole prefix cached; every
    request is admitted in the order it came."""
    scheduler = _scheduler(tiny_model_dir, schedule_policy="fcfs", max_running_requests=1)
    _warm(scheduler, SHARED)
    reqs = _submit(
        scheduler, [_prompt(23, 10), SHARED + [60, 61], _prompt(24, 8), SHARED + [62, 63]], 2
    )
    order = []
    for _ in range(MAX_STEPS):
        if not scheduler.has_work():
            break
        scheduler.step()
        check_scheduler(scheduler)
        order += [r for r in scheduler.running if r not in order]
    assert order == reqs
    assert_no_leak(scheduler)


def test_dfs_weight_runs_heaviest_subtree_first(tiny_model_dir):
    """dfs-weight admits from the prefix most waiting requests share, though another prefix's
    request came first; its order groups requests by shared prefix, heaviest group first."""
    scheduler = _scheduler(tiny_model_dir, schedule_policy="dfs-weight", max_running_requests=1)
    light, heavy = _prompt(25, 24), _prompt(26, 24)
    _warm(scheduler, light, heavy)
    a1, b1, a2, b2, b3 = _submit(
        scheduler, [light + [70], heavy + [71], light + [72, 73], heavy + [74, 75], heavy + [76]], 2
    )
    assert order_waiting("dfs-weight", scheduler.waiting, scheduler.kv) == [b1, b2, b3, a1, a2]
    assert _admitted_first(scheduler) is b1
    _drain(scheduler)
    assert_no_leak(scheduler)


def test_forward_counters_count_what_the_forwards_computed(tiny_model_dir):
    """One request, prompt P in one prefill, then N - 1 decodes: the counters the benchmark's
    floors read are exact."""
    p, n = 20, 6
    scheduler = _scheduler(tiny_model_dir)
    _submit(scheduler, [_prompt(0, p)], max_new_tokens=n)
    while scheduler.has_work():
        scheduler.step()
    stats = scheduler.stats()
    assert stats["forward_steps"] == n and stats["logit_rows"] == n
    assert stats["forward_tokens"] == p + n - 1
    assert stats["attention_pairs"] == p * (p + 1) // 2 + sum(p + i for i in range(1, n))


def test_check_prompt_refuses_what_the_model_or_pool_cannot_take():
    """Model-free: the admission checks of a prompt, each with its own error."""
    from radixrt.engine.scheduler import check_prompt
    from radixrt.protocol import RequestError

    ok = _params(4)
    check_prompt([1, 2, 3], ok, vocab=10, context=8, pool=16)
    for ids, words in (([], "empty"), ([1, 10], r"\[0, 10\)"), ([1, True], "ints")):
        with pytest.raises(ValueError, match=words):
            check_prompt(ids, ok, vocab=10, context=8, pool=16)
    for context, pool in ((4, 16), (16, 4)):
        with pytest.raises(RequestError, match="at most 3"):
            check_prompt([1, 2, 3, 4], ok, vocab=10, context=context, pool=pool)
