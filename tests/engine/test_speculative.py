"""Speculative decoding with n-gram drafts on the default model: greedy output is unchanged
(against transformers and against decoding without drafts), sampling stays reproducible, every
slot of a rejected draft comes back, and constraints, stops, logprobs and streams compose."""

from __future__ import annotations

import json

import pytest

import radixrt as rt
from radixrt.engine.scheduler import Scheduler
from radixrt.sampling_params import SamplingParams

from helpers import hf_greedy, make_scheduler
from ownership import assert_no_leak, assert_slot_ownership
from timeouts import REPLY_TIMEOUT_S

SPEC = {"speculative_algorithm": "ngram"}
MAX_NEW = 40
TRANSCRIPT = (
    "You are an agent. Each step: a thought, one tool call as JSON, then its observation.\n"
    "Step 1:\nThought: I need the weather.\n"
    'Call: {"tool": "weather", "arguments": {"city": "Lisbon"}}\nObservation: sunny\n'
    "Step 2:\nThought: I need the weather.\n"
    'Call: {"tool": "weather", "arguments": {"city": "Oslo"}}\nObservation: rain\n'
    "Step 3:\n"
)


@pytest.fixture(scope="module")
def transcript(default_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(
        TRANSCRIPT, add_special_tokens=False
    )
    return ids, hf_greedy(default_model_dir, [ids], MAX_NEW)[0]


def _scheduler(model_dir, **args) -> Scheduler:
    return make_scheduler(
        model_dir, **{"attention_backend": "auto", "max_total_tokens": 2048, **args}
    )


def _run(scheduler: Scheduler, prompts, params: dict, abort_after: int | None = None):
    """Drive the scheduler to the end, checking slot ownership after every step; returns the
    requests. `abort_after`: abort the first request after that many steps."""
    reqs = [
        scheduler.make_request(f"r{i}", list(p), SamplingParams.from_dict(params), i)
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.add_request(req)
    steps = 0
    while scheduler.has_work():
        scheduler.step()
        steps += 1
        if steps == abort_after:
            scheduler.abort("r0")
        scheduler.check_invariants()
        assert_slot_ownership(scheduler.memory_snapshot())
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_agent_transcript_matches_transformers(default_model_dir, transcript, page_size):
    ids, expected = transcript
    scheduler = _scheduler(default_model_dir, page_size=page_size, **SPEC)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    for attempt in ("cold", "warm"):  # warm: the corpus holds the cold run's answer
        (req,) = _run(scheduler, [ids], greedy)
        assert req.output_ids == expected, attempt
        meta = req.meta_info()
        assert meta["spec_accepted_tokens"] > 0
        assert meta["forward_passes"] < MAX_NEW - meta["spec_accepted_tokens"] // 2
    stats = scheduler.stats()
    assert stats["spec_accept_length"] > 2
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]  # some drafts were rejected
    assert_no_leak(scheduler)


def test_sampled_output_is_reproducible_with_a_seed(default_model_dir, transcript):
    """A seeded sampled request gives the same tokens with drafts as without: a draft is
    accepted when the token drawn as usual equals it, one draw per token either way, so what
    the timing-priced drafter proposes cannot shift the request's generator."""
    ids, _ = transcript
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.7, "seed": 11, "ignore_eos": True}
    outs = []
    for spec in (SPEC, {}):
        scheduler = _scheduler(default_model_dir, **spec)
        outs.append([r.output_ids for r in _run(scheduler, [ids, ids], params)])
        assert (scheduler.stats()["spec_verifications"] > 0) == bool(spec)
    assert outs[0] == outs[1]
    assert outs[0][0] != outs[0][1]  # two samples (seed + index) differ


def test_no_slot_leaks_with_rejections_aborts_and_preemption(default_model_dir, transcript):
    """A pool too small for eight transcript tails to finish together (admission reserves 70%
    of their outputs; they write all of it): drafts are dropped, a request retracted and
    readmitted, one aborted mid-run; every step's ownership holds, and all comes back."""
    ids, _ = transcript
    scheduler = _scheduler(
        default_model_dir, max_total_tokens=64, page_size=4, max_running_requests=6, **SPEC
    )
    prompts = [ids[-8 - 2 * i :] for i in range(8)]
    new = 24
    greedy = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    reqs = _run(scheduler, prompts, greedy, abort_after=6)
    stats = scheduler.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_verifications"] > 0
    assert reqs[0].finish_reason.type == "abort" and 0 < len(reqs[0].output_ids) < new
    assert [r.output_ids for r in reqs[1:]] == hf_greedy(default_model_dir, prompts[1:], new)
    assert_no_leak(scheduler)


@pytest.mark.parametrize(
    "backend, age",
    [
        ("outlines", {"type": "integer", "maxDigits": 2}),
        ("llguidance", {"type": "integer", "minimum": 0, "maximum": 99}),
    ],
)
def test_constrained_json_always_matches_its_schema(default_model_dir, backend, age):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": age,
            "city": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "age", "city"],
    }
    scheduler = _scheduler(default_model_dir, grammar_backend=backend, **SPEC)
    tok = scheduler.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Describe Ada from Lisbon as JSON with name, age, city."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    for temperature in (0, 1.0):
        params = {
            "max_new_tokens": 64,
            "temperature": temperature,
            "json_schema": json.dumps(schema),
        }
        for round_ in range(3):  # later rounds draft from the earlier answers
            for req in _run(scheduler, [ids] * 3, {**params, "seed": round_}):
                record = json.loads(req.text)
                assert set(record) == {"name", "age", "city"}, req.text
                assert isinstance(record["age"], int) and 0 <= record["age"] < 100
                assert len(record["name"]) <= 12 and len(record["city"]) <= 12
    assert scheduler.stats()["spec_accepted_tokens"] > 0
    assert_no_leak(scheduler)


def test_stops_and_logprobs_equal_decoding_without_drafts(default_model_dir, transcript):
    ids, _ = transcript
    params = {
        "max_new_tokens": MAX_NEW,
        "temperature": 0,
        "stop": ["Step 5"],
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    runs = {}
    for name, args in (("off", {}), ("on", SPEC)):
        scheduler = _scheduler(default_model_dir, **args)
        runs[name] = _run(scheduler, [ids, ids], params)  # the second drafts from the first
    for plain, spec in zip(runs["off"], runs["on"]):
        assert spec.text == plain.text and spec.output_ids == plain.output_ids
        assert spec.finish_reason == plain.finish_reason
        assert len(spec.output_token_logprobs) == len(spec.output_ids)
        for (a, ta), (b, tb) in zip(plain.output_token_logprobs, spec.output_token_logprobs):
            assert ta == tb and a == pytest.approx(b, abs=1e-3)
        assert [[t for _, t in top] for top in spec.output_top_logprobs] == [
            [t for _, t in top] for top in plain.output_top_logprobs
        ]
    assert runs["on"][1].meta_info()["spec_accepted_tokens"] > 0


def test_engine_streams_accepted_tokens_as_one_delta(default_model_dir, transcript):
    ids, expected = transcript
    with rt.Engine(
        model=str(default_model_dir),
        max_total_tokens=2048,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        **SPEC,
    ) as engine:
        greedy = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        chunks = list(engine.generate(input_ids=ids, sampling_params=greedy, stream=True))
        final = chunks[-1]
        assert final["output_ids"] == expected
        assert [t for c in chunks[:-1] for t in c["token_ids"]] == expected
        assert "".join(c["delta"] for c in chunks[:-1]) == final["text"]
        assert max(len(c["token_ids"]) for c in chunks[:-1]) > 1
        samples = engine.generate(input_ids=ids, sampling_params={**greedy, "n": 2})
        assert [s["output_ids"] for s in samples] == [expected, expected]
        assert all(s["meta_info"]["spec_accepted_tokens"] > 0 for s in samples)
        stats = engine.stats()
        assert stats["spec_accept_length"] > 1
        engine.check_invariants()
