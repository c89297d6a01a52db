"""Sampling parameters, tested for their effect on what is sampled.

Each step's raw top logprobs (`top_logprobs_num`, before penalties and filters) let the tests
check the rule a parameter states, token by token: with temperature 1 a token's sampling
probability before filtering is exp(its raw logprob).
"""

from __future__ import annotations

import math

import pytest

TOP = 20  # the most top logprobs the runtime returns per step
EPS = 1e-4
SEEDS = range(4)
PROMPT = "Once upon a time"
GREEDY = {"temperature": 0}

Step = tuple[int, list[tuple[float, int]]]  # a sampled token; its step's raw top-20 [logprob, id]


@pytest.fixture(scope="module")
def tiny(tiny_runtime):
    """The tiny random model: flat next-token distributions, so filters have much to remove."""
    return tiny_runtime


@pytest.fixture(scope="module")
def smol(default_runtime):
    """The default model: a real LM, whose greedy continuations repeat themselves."""
    return default_runtime


def _generate(engine, prompt: str, variants: list[dict], **common) -> list[dict]:
    """One request per variant of the sampling parameters (plus `common`), all sent at once, so
    they run in one batch."""
    base = {"max_new_tokens": 16, "ignore_eos": True, **common}
    return engine.generate([prompt] * len(variants), [{**base, **v} for v in variants])


def _many(engine, prompt: str, variants: list[dict], **common) -> list[list[int]]:
    """The output ids of each variant."""
    return [out["output_ids"] for out in _generate(engine, prompt, variants, **common)]


def _steps(engine, prompt: str, variants: list[dict]) -> list[list[Step]]:
    """The steps of each variant."""
    outs = _generate(engine, prompt, variants, return_logprob=True, top_logprobs_num=TOP)
    return [
        list(zip(out["output_ids"], out["meta_info"]["output_top_logprobs"], strict=True))
        for out in outs
    ]


def _seeded_steps(engine, prompt: str, **params) -> list[Step]:
    """The steps of one seeded sample per seed, in one list."""
    per_seed = _steps(engine, prompt, [{"seed": seed, **params} for seed in SEEDS])
    return [step for steps in per_seed for step in steps]


# ---- filters that leave only the top token --------------------------------------------------
@pytest.mark.parametrize(
    "only_top", [{"min_p": 1.0}, {"min_p": 0.99}, {"top_p": 1e-6}, {"top_k": 1}]
)
def test_filters_that_keep_one_token_sample_the_greedy_tokens(tiny, only_top):
    """min_p ~ 1, a tiny top_p or top_k 1 keep only the most likely token: whatever the seed, at
    temperature 2, the sample is exactly the greedy continuation."""
    variants = [{"temperature": 2.0, "seed": seed, **only_top} for seed in SEEDS]
    greedy, *samples = _many(tiny, PROMPT, [GREEDY, *variants])
    assert samples == [greedy] * len(SEEDS)


def test_unfiltered_high_temperature_varies_with_the_seed(tiny):
    """top_p 1 at temperature 2: the four seeds give four different samples, none greedy, and a
    seed gives the same sample again."""
    variants = [{"temperature": 2.0, "top_p": 1.0, "seed": seed} for seed in SEEDS]
    greedy, *samples = _many(tiny, PROMPT, [GREEDY, *variants])
    assert len({tuple(s) for s in samples}) == len(SEEDS) and greedy not in samples
    assert _many(tiny, PROMPT, variants[:1]) == samples[:1]


# ---- filters checked token by token against the raw distribution ---------------------------
def test_top_k_samples_only_among_the_k_most_likely(tiny):
    """top_k 3: every sampled token is one of its step's 3 most likely tokens, and over the seeds
    more than the top one is sampled."""
    ranks = []
    for token, top in _seeded_steps(tiny, PROMPT, temperature=1.5, top_k=3):
        ids = [tid for _, tid in top]
        assert token in ids[:3]
        ranks.append(ids.index(token))
    assert set(ranks) == {0, 1, 2}


def test_top_p_samples_only_inside_the_nucleus(tiny):
    """top_p 0.2 at temperature 1: every sampled token is in the smallest head of the sorted
    distribution whose mass reaches 0.2 (the mass of the tokens above it is at most 0.2), and not
    only the top token is sampled."""
    p, ranks = 0.2, []
    for token, top in _seeded_steps(tiny, PROMPT, temperature=1.0, top_p=p):
        ids = [tid for _, tid in top]
        above = ids.index(token) if token in ids else len(ids)  # beyond the top 20: all 20 above
        assert sum(math.exp(lp) for lp, _ in top[:above]) <= p + EPS
        ranks.append(above)
    assert max(ranks) > 0


def test_min_p_samples_only_tokens_near_the_top(tiny):
    """min_p 0.3 at temperature 1: every sampled token has at least 0.3 times the probability of
    its step's most likely token, and not only the top token is sampled."""
    steps = _seeded_steps(tiny, PROMPT, temperature=1.0, min_p=0.3)
    for token, top in steps:
        logprob = {tid: lp for lp, tid in top}
        assert token in logprob and logprob[token] >= math.log(0.3) + top[0][0] - EPS
    assert any(token != top[0][1] for token, top in steps)


# ---- penalties ------------------------------------------------------------------------------
REPETITIVE = "The capital of France is"  # the default model's greedy answer soon repeats itself


def test_penalties_reduce_repetition(smol):
    """Greedy over 24 tokens repeats itself; frequency, presence and repetition penalties of 2
    give more distinct tokens, a frequency penalty of -2 fewer."""
    penalties = [
        {},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
        {"frequency_penalty": -2.0},
    ]
    outs = _many(smol, REPETITIVE, penalties, temperature=0, max_new_tokens=24)
    base, *penalised, negative = (len(set(ids)) for ids in outs)
    assert base < 20  # the premise: plain greedy repeats
    assert all(d > base for d in penalised), (base, penalised)
    assert negative < base


def test_greedy_with_an_additive_penalty_takes_the_best_penalised_token(smol):
    """Greedy with frequency (presence) penalty f picks, at every step, the token maximising
    raw logprob - f * (count (presence) of the token in the output so far). A token beyond the
    raw top 20 scores at most the 20th's raw logprob, as the penalty is positive. Both answers
    differ from plain greedy's."""
    f = 1.5
    variants = [GREEDY, {**GREEDY, "frequency_penalty": f}, {**GREEDY, "presence_penalty": f}]
    greedy, frequency, presence = _steps(smol, REPETITIVE, variants)
    for steps, weight in ((frequency, lambda n: n), (presence, lambda n: min(n, 1))):
        seen: list[int] = []
        for token, top in steps:
            scores = {tid: lp - f * weight(seen.count(tid)) for lp, tid in top}
            chosen = scores[token] if token in scores else top[-1][0]  # beyond the top 20: a bound
            assert chosen >= max(scores.values()) - EPS, (token, seen)
            seen.append(token)
        assert seen != [token for token, _ in greedy]  # the premise: the penalty changed the answer


def test_penalties_on_output_leave_the_first_token_alone(smol):
    """Frequency and presence penalties count output tokens only, so the first token is greedy's;
    the repetition penalty also covers prompt tokens and changes the first token of a prompt whose
    greedy continuation repeats a prompt token."""
    counting = "1, 2, 3, 1, 2, 3,"
    variants = [
        {},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
    ]
    for prompt in (REPETITIVE, counting):
        greedy, frequency, presence, repetition = _many(
            smol, prompt, variants, temperature=0, max_new_tokens=1
        )
        assert frequency == presence == greedy
    assert greedy[0] in smol.tokenize(counting)  # the premise: greedy continues with a prompt token
    assert repetition != greedy


# ---- logit_bias -----------------------------------------------------------------------------
def test_logit_bias_adds_to_the_logit_in_a_mixed_batch(tiny):
    """Greedy picks argmax(logit + bias): the runner-up biased by a little more than its gap to
    the best wins the first step, by a little less it does not; +100 forces a token at any
    temperature; rows without a bias in the same batch stay greedy."""
    ((best, top), *_), *_ = _steps(tiny, PROMPT, [{**GREEDY, "max_new_tokens": 1}])
    (lp_best, _), (lp_second, second) = top[:2]
    gap = lp_best - lp_second
    forced = top[5][1]
    outs = _many(
        tiny,
        PROMPT,
        [
            {**GREEDY, "logit_bias": {str(second): gap + 0.05}},
            {**GREEDY, "logit_bias": {second: max(gap - 0.05, 0.0)}},
            {"temperature": 1.5, "seed": 1, "logit_bias": {forced: 100}},
            GREEDY,
        ],
        max_new_tokens=3,
    )
    plain = _many(tiny, PROMPT, [GREEDY], max_new_tokens=3)[0]
    assert outs[0][0] == second and outs[1][0] == best == plain[0]
    assert outs[2] == [forced] * 3 and outs[3] == plain


@pytest.mark.parametrize(
    "bias, words",
    [
        ({"x": 1}, "token id"),
        ({"3": 100.5}, r"logit_bias\[3\] must be in"),
        ({10**6: 1}, "token ids must be in"),
    ],
)
def test_bad_logit_bias_is_refused(tiny, bias, words):
    with pytest.raises(ValueError, match=words):
        tiny.generate(PROMPT, {"max_new_tokens": 1, "logit_bias": bias})
