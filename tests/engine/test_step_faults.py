"""Faults inside a step cost requests, never the scheduler: an exception raised in the forward
of one step ends that step's requests with `internal_error` (their slots freed), one raised in a
single request's own work ends that request alone, and a row of logits nothing can be drawn
from never reaches `multinomial`. The tiny model runs in-process; the faults are injected into
the real runner for one call each."""

from __future__ import annotations

import pytest
import torch

from radixrt.engine.scheduler import Scheduler
from radixrt.protocol import ErrorCode
from radixrt.sampling_params import SamplingParams

from helpers import drain, hf_greedy, make_scheduler
from ownership import assert_no_leak, check_scheduler


def _prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [1000 + seed] + torch.randint(2000, 40000, (n - 1,), generator=gen).tolist()


def _submit(scheduler: Scheduler, prompts, tag: str, **params):
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, **params}
    reqs = [
        scheduler.make_request(f"{tag}{i}", p, SamplingParams.from_dict(sp))
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.add_request(req)
    return reqs


def _drain(scheduler: Scheduler) -> None:
    drain(scheduler, check_scheduler)


def _error(req) -> ErrorCode | None:
    return req.finish_reason.error if req.finish_reason else None


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_forward_that_raises_ends_only_its_steps_requests(tiny_model_dir, monkeypatch, page_size):
    scheduler = make_scheduler(tiny_model_dir, page_size=page_size)
    forward, calls = scheduler.runner.forward, []

    def faulty_forward(batch):
        calls.append(len(batch.extend_lens))
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return forward(batch)

    monkeypatch.setattr(scheduler.runner, "forward", faulty_forward)
    early = _submit(scheduler, [_prompt(i, 9 + i) for i in range(3)], "early")
    _drain(scheduler)
    assert all(_error(r) == ErrorCode.INTERNAL_ERROR for r in early), "the step's requests"
    assert "injected fault" in early[0].finish_reason.message
    assert scheduler.stats()["failed_steps"] == 1

    prompts = [_prompt(10 + i, 7 + i) for i in range(3)]
    later = _submit(scheduler, prompts, "later")
    _drain(scheduler)
    assert [r.output_ids for r in later] == hf_greedy(tiny_model_dir, prompts, 6)
    assert_no_leak(scheduler)


def test_a_fault_in_one_requests_own_work_ends_that_request_alone(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir)
    prompts = [_prompt(20 + i, 8) for i in range(3)]
    reqs = _submit(scheduler, prompts, "r")

    def broken(token: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    reqs[1].detokenizer.add = broken
    _drain(scheduler)
    assert _error(reqs[1]) == ErrorCode.INTERNAL_ERROR
    expected = hf_greedy(tiny_model_dir, [prompts[0], prompts[2]], 6)
    assert [reqs[0].output_ids, reqs[2].output_ids] == expected
    assert_no_leak(scheduler)


def test_non_finite_logits_never_reach_the_sampler(tiny_model_dir, monkeypatch):
    """A NaN row (a model fault) ends its request with internal_error; the batch's other rows,
    greedy and sampled, are drawn as usual."""
    scheduler = make_scheduler(tiny_model_dir)
    logits, poisoned = scheduler.runner.logits, []

    def nan_in_first_row(hidden):
        out = logits(hidden).clone()
        if not poisoned and len(out) == 3:
            out[0, 5] = float("nan")
            poisoned.append(True)
        return out

    monkeypatch.setattr(scheduler.runner, "logits", nan_in_first_row)
    prompts = [_prompt(30 + i, 8) for i in range(3)]
    reqs = _submit(scheduler, prompts[:2], "s", temperature=1.0, seed=3)
    reqs += _submit(scheduler, prompts[2:], "g")
    _drain(scheduler)
    assert poisoned and _error(reqs[0]) == ErrorCode.INTERNAL_ERROR
    assert "non-finite" in reqs[0].finish_reason.message
    assert _error(reqs[1]) is None and len(reqs[1].output_ids) == 6
    assert reqs[2].output_ids == hf_greedy(tiny_model_dir, prompts[2:], 6)[0]
    assert_no_leak(scheduler)


def test_a_constraint_that_leaves_no_token_is_the_requests_error(tiny_model_dir):
    """The constraint allows one digit while min_new_tokens bans every digit (they are its stop
    tokens): nothing may be drawn, which is the request's own doing (invalid_request)."""
    scheduler = make_scheduler(tiny_model_dir)
    digits = scheduler.tokenizer.convert_tokens_to_ids(list("0123456789"))
    (req,) = _submit(
        scheduler, [_prompt(40, 6)], "c", regex="[0-9]", min_new_tokens=1, stop_token_ids=digits
    )
    (other,) = _submit(scheduler, [_prompt(41, 6)], "o")
    _drain(scheduler)
    assert _error(req) == ErrorCode.INVALID_REQUEST, req.finish_reason
    assert _error(other) is None and len(other.output_ids) == 6
    assert_no_leak(scheduler)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-300},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"seed": 1 << 64},
        {"seed": -1},
        {"repetition_penalty": 1e-300},
        {"stop": ["x" * 5000]},
        {"stop": [str(i) for i in range(100)]},
        {"stop_token_ids": list(range(5000))},
    ],
)
def test_values_past_their_bounds_are_refused_at_the_door(params):
    with pytest.raises(ValueError):
        SamplingParams.from_dict(params)


@pytest.mark.parametrize(
    "params",
    [
        {"stop_token_ids": [10**6], "min_new_tokens": 2},
        {"top_k": 10**6},
    ],
)
def test_ids_past_the_vocabulary_are_refused_at_admission(tiny_model_dir, params):
    scheduler = make_scheduler(tiny_model_dir)
    with pytest.raises(ValueError, match="vocabulary|in \\[0"):
        scheduler.make_request("r", [5, 6, 7], SamplingParams.from_dict(params))
