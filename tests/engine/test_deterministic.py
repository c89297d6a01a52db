"""`--enable-deterministic-inference`: a request's tokens and every returned logprob (top-5 too)
are bitwise the same served alone on a cold cache, in a batch of 32 mixed requests, after its
prefix was cached by another request, with `--chunked-prefill-size 64`, with n-gram speculation,
at `--tp-size 2`, with the host tier serving its prefix, and as one of `n = 4` seeded samples;
greedy and seeded-sampled, for float32, int8 and int4 weights (the tiny random Llama). Without
the mode the logprobs do move; on the default model the mode keeps transformers' greedy tokens.

40 prompts of 8 to 150 tokens for float32, the first 16 of them for int8 and int4 (the file's
time); n-gram speculation serves the first 16 one at a time (where drafting pays); the n = 4 check
takes the first 8 (each sample j is compared with its own seed, seed + j, served alone)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

import radixrt as rt

from helpers import hf_greedy
from timeouts import REPLY_TIMEOUT_S

MAX_NEW = 4
PROMPTS_N, BATCH, SAMPLES_N, SPEC_N = 40, 32, 8, 16
QUANTIZED_N = 16  # prompts of the int8 and int4 matrix
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 5}
SEED = 1000


def _prompts() -> list[list[int]]:
    """Mixed lengths; each prompt's second half repeats a stretch of its first, so the n-gram
    drafter finds drafts in it."""
    rng = random.Random(0)
    prompts = []
    for _ in range(PROMPTS_N):
        head = [rng.randrange(100, 20000) for _ in range(rng.randrange(4, 76))]
        prompts.append(head + head[: rng.randrange(4, len(head) + 1)])
    return prompts


PROMPTS = _prompts()


def _sampled(seed: int) -> dict:
    return {**GREEDY, "temperature": 0.9, "top_k": 50, "seed": seed}


def _requests(n: int) -> list[tuple[list[int], dict]]:
    """The first `n` prompts greedy and sampled (each its own seed), interleaved: 2n requests."""
    out = []
    for i, p in enumerate(PROMPTS[:n]):
        out += [(p, {**GREEDY, **LOGPROBS}), (p, {**_sampled(SEED + 8 * i), **LOGPROBS})]
    return out


@dataclass(frozen=True)
class Output:
    """What a request returned: tokens, each token's logprob and its top-5, as returned."""

    tokens: tuple[int, ...]
    logprobs: tuple
    top: tuple

    @classmethod
    def of(cls, out: dict) -> Output:
        meta = out["meta_info"]
        return cls(
            tuple(out["output_ids"]),
            tuple(map(tuple, meta["output_token_logprobs"])),
            tuple(tuple(map(tuple, row)) for row in meta["output_top_logprobs"]),
        )


def _engine(model, quantization: str | None = None, **overrides) -> rt.Engine:
    return rt.Engine(
        model=str(model),
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        quantization=quantization,
        **{"max_total_tokens": 4096, **overrides},
    )


def _batched(engine, requests: list[tuple[list[int], dict]]) -> list[Output]:
    """`requests` in batches of BATCH, each batch sent together (lengths and kinds mixed)."""
    outs: list[Output] = []
    for start in range(0, len(requests), BATCH):
        part = requests[start : start + BATCH]
        got = engine.generate(input_ids=[p for p, _ in part], sampling_params=[s for _, s in part])
        outs += [Output.of(o) for o in got]
    return outs


def _alone(engine, requests: list[tuple[list[int], dict]]) -> list[Output]:
    """Each request by itself on a cold cache."""
    outs = []
    for prompt, params in requests:
        engine.flush_cache()
        outs.append(Output.of(engine.generate(input_ids=prompt, sampling_params=params)))
    return outs


def _cache_halves(engine, prompts: list[list[int]] = PROMPTS) -> None:
    """Another request on each prompt's first half, one token: the prefixes are then cached."""
    halves = [p[: len(p) // 2] for p in prompts]
    engine.generate(input_ids=halves, sampling_params={**GREEDY, "max_new_tokens": 1})


def _differing(got: list[Output], expected: list[Output]) -> list[int]:
    assert len(got) == len(expected)
    return [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]


# ---- the matrix: one runtime per configuration, shared by the module -------------------------
@pytest.fixture(scope="module", params=[None, "int8", "int4"], ids=["float32", "int8", "int4"])
def quantization(request):
    return request.param


@pytest.fixture(scope="module")
def requests(quantization) -> list[tuple[list[int], dict]]:
    return _requests(PROMPTS_N if quantization is None else QUANTIZED_N)


@pytest.fixture(scope="module")
def base(tiny_model_dir, quantization):
    with _engine(tiny_model_dir, quantization, enable_deterministic_inference=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(base, requests) -> list[Output]:
    """Every request alone on a cold cache: what every other condition must return."""
    return _alone(base, requests)


def test_batched_and_cached_equal_alone(base, requests, reference):
    base.flush_cache()
    assert not _differing(_batched(base, requests), reference)
    base.flush_cache()
    _cache_halves(base)
    before = base.stats()["cache_hit_rate"]
    assert not _differing(_batched(base, requests), reference)
    assert base.stats()["cache_hit_rate"] > before  # the prefixes did come from the cache


def test_n4_seeded_samples_equal_each_seed_alone(base, reference):
    """Sample j of n = 4 with seed s is the request with seed s + j served alone."""
    singles = [
        (PROMPTS[i], {**_sampled(SEED + 8 * i + j), **LOGPROBS})
        for i in range(SAMPLES_N)
        for j in range(4)
    ]
    expected = _alone(base, singles)
    assert expected[::4] == reference[1 : 2 * SAMPLES_N : 2]  # sample 0: the sampled reference
    base.flush_cache()
    got: list[Output] = []
    for i in range(SAMPLES_N):
        params = {**_sampled(SEED + 8 * i), **LOGPROBS, "n": 4}
        got += [Output.of(o) for o in base.generate(input_ids=PROMPTS[i], sampling_params=params)]
    assert not _differing(got, expected)
    assert len({o.tokens for o in got[:4]}) > 1  # the samples do differ from one another


@pytest.mark.parametrize(
    "condition",
    [
        {"chunked_prefill_size": 64},
        {"speculative_algorithm": "ngram"},
        {"tp_size": 2},
        {"enable_hierarchical_cache": True, "max_total_tokens": 1024},
    ],
    ids=["chunked-64", "ngram", "tp2", "host-tier"],
)
def test_served_otherwise_equals_alone(
    tiny_model_dir, quantization, requests, reference, condition
):
    with _engine(
        tiny_model_dir, quantization, enable_deterministic_inference=True, **condition
    ) as engine:
        if condition.get("enable_hierarchical_cache"):
            # the halves overflow the device pool into the host: many prefixes come back from it
            _cache_halves(engine)
        if "speculative_algorithm" in condition:
            # one at a time, where drafting pays: each draws on its prompt and earlier answers
            got = [
                Output.of(engine.generate(input_ids=p, sampling_params=s))
                for p, s in requests[: 2 * SPEC_N]
            ]
        else:
            got = _batched(engine, requests)
        stats = engine.stats()
    assert not _differing(got, reference[: len(got)])
    if "speculative_algorithm" in condition:
        assert stats["spec_draft_tokens"] > 0
    if "enable_hierarchical_cache" in condition:
        assert stats["host_hit_tokens"] > 0


# ---- outside the mode, and the default model ---------------------------------------------------
def test_without_the_mode_logprobs_move(tiny_model_dir):
    """The fast path's logprobs depend on the batch: the mode is not a no-op."""
    greedy = _requests(SAMPLES_N)[::2]
    with _engine(tiny_model_dir) as engine:
        alone = _alone(engine, greedy)
        engine.flush_cache()
        batched = _batched(engine, greedy)
    assert [g.tokens for g in batched] == [a.tokens for a in alone]
    assert _differing(batched, alone)


def test_default_model_keeps_transformers_tokens_and_its_bits(default_model_dir):
    """The default model under the mode: transformers' greedy tokens, and the same bits alone,
    batched and after a cache hit."""
    prompts = PROMPTS[:4]
    greedy = [(p, {**GREEDY, **LOGPROBS}) for p in prompts]
    with _engine(default_model_dir, enable_deterministic_inference=True) as engine:
        alone = _alone(engine, greedy)
        engine.flush_cache()
        batched = _batched(engine, greedy)
        _cache_halves(engine, prompts)
        cached = _batched(engine, greedy)
    assert not _differing(batched, alone) and not _differing(cached, alone)
    assert [list(a.tokens) for a in alone] == hf_greedy(default_model_dir, prompts, MAX_NEW)
