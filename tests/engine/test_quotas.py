"""Quotas that bound one client, on the in-process scheduler and the tiny model: pinned prefix
tokens per client, and prompt logprobs computed in bounded chunks (equal to transformers')."""

from __future__ import annotations

import pytest
import torch

from radixrt.engine.output_processor import PROMPT_LOGPROB_ROWS
from radixrt.engine.scheduler import Scheduler
from radixrt.protocol import ErrorCode, RequestError
from radixrt.sampling_params import SamplingParams

from helpers import _hf_model, make_scheduler, run_in_process


def _scheduler(model_dir, **overrides) -> Scheduler:
    return make_scheduler(model_dir, **{"max_total_tokens": 1024, **overrides})


def _prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2000, 40000, (n,), generator=gen).tolist()


def test_a_client_pins_at_most_its_quota(tiny_model_dir):
    scheduler = _scheduler(tiny_model_dir, max_pinned_tokens_per_client=60)
    prefixes = [_prompt(i, 40) for i in range(3)]
    run_in_process(scheduler, [prefixes], {"max_new_tokens": 1, "temperature": 0})
    assert scheduler.pin("a/1", prefixes[0], owner="a/") == 40
    with pytest.raises(RequestError) as refused:
        scheduler.pin("a/2", prefixes[1], owner="a/")
    assert refused.value.code == ErrorCode.RATE_LIMITED
    assert scheduler.pin("b/1", prefixes[1], owner="b/") == 40, "another client's own quota"
    assert scheduler.unpin("a/1") and scheduler.pin("a/2", prefixes[2], owner="a/") == 40
    assert sorted(scheduler.kv.pins) == ["a/2", "b/1"]
    scheduler.unpin_all("a/")
    scheduler.unpin_all("b/")
    scheduler.check_invariants()
    assert scheduler.flush_cache()
    assert scheduler.stats()["free_tokens"] == scheduler.stats()["total_tokens"]


def test_prompt_logprobs_in_chunks_equal_transformers(tiny_model_dir):
    """A prompt longer than one chunk of logits rows, scored from position 3 on."""
    n = PROMPT_LOGPROB_ROWS * 2 + 37
    ids = _prompt(7, n)
    scheduler = _scheduler(tiny_model_dir, chunked_prefill_size=-1)
    params = SamplingParams.from_dict(
        {"max_new_tokens": 0, "logprob_start_len": 3, "return_logprob": True}
    )
    req = scheduler.make_request("score", ids, params)
    scheduler.add_request(req)
    while scheduler.has_work():
        scheduler.step()
    with torch.inference_mode():
        logits = _hf_model(str(tiny_model_dir))(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3, n - 1), ids[4:]]
    assert req.input_token_logprobs[0] == (None, ids[3])  # the first token's: not computed
    got = torch.tensor([lp for lp, _ in req.input_token_logprobs[1:]])
    assert [t for _, t in req.input_token_logprobs[1:]] == ids[4:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
