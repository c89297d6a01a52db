"""Invariant 1: the cache never changes the answer (greedy == transformers, token for token)."""

from __future__ import annotations

import pytest

from radixrt.sampling_params import SamplingParams

from helpers import drain, hf_greedy, make_scheduler, run_in_process, shared_prefix_prompts
from ownership import assert_no_leak

MAX_NEW = 12

CONFIGS = {
    "default": {},
    "no-radix-cache": {"disable_radix_cache": True},
    "tiny-chunks": {"chunked_prefill_size": 5, "max_prefill_tokens": 24},
    "page-size-4": {"page_size": 4},
    "tiny-pool": {"max_total_tokens": 96, "max_running_requests": 8},
    "fcfs": {"schedule_policy": "fcfs"},
    "dfs-weight": {"schedule_policy": "dfs-weight"},
    # the warm run drafts the cold run's answers from the corpus: nearly all accepted
    "speculative": {"speculative_algorithm": "ngram"},
    # the host tier: swap preemption, and prefixes evicted by the small pool loaded back
    "hicache-tiny-pool": {
        "enable_hierarchical_cache": True,
        "max_total_tokens": 96,
        "max_running_requests": 8,
    },
    "hicache-write-back-pages": {
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_back",
        "max_total_tokens": 96,
        "max_running_requests": 8,
        "page_size": 4,
    },
    "speculative-tiny-pool-pages": {
        "speculative_algorithm": "ngram",
        "max_total_tokens": 96,
        "max_running_requests": 8,
        "page_size": 4,
    },
}


def _run_twice(folder, prompts, expected, overrides):
    """Every prompt at once, cold and then warm, on an in-process scheduler (the production
    attention backend, a 4096-token pool unless `overrides` say otherwise), checking both runs
    against transformers and the pool after them; returns the warm run's requests and the stats
    before the flush."""
    scheduler = make_scheduler(
        folder, **{"attention_backend": "auto", "max_total_tokens": 4096, **overrides}
    )
    params = SamplingParams.from_dict(
        {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    )
    for attempt in ("cold", "warm"):
        reqs = [scheduler.make_request(f"{attempt}{i}", p, params) for i, p in enumerate(prompts)]
        for req in reqs:
            scheduler.add_request(req)
        drain(scheduler)
        mismatched = [i for i, (r, e) in enumerate(zip(reqs, expected)) if r.output_ids != e]
        assert not mismatched, f"{attempt} run differs from the reference on prompts {mismatched}"
    stats = scheduler.stats()
    assert_no_leak(scheduler)
    return reqs, stats


@pytest.fixture(scope="module")
def tiny_case(tiny_model_dir):
    from transformers import AutoTokenizer

    prompts = shared_prefix_prompts(AutoTokenizer.from_pretrained(tiny_model_dir))
    return tiny_model_dir, prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def default_case(default_model_dir):
    from transformers import AutoTokenizer

    prompts = shared_prefix_prompts(AutoTokenizer.from_pretrained(default_model_dir))
    return default_model_dir, prompts, hf_greedy(default_model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_model_matches_transformers(tiny_case, name):
    folder, prompts, expected = tiny_case
    reqs, stats = _run_twice(folder, prompts, expected, CONFIGS[name])
    if name == "default":
        assert stats["cache_hit_rate"] > 0.5
        assert all(r.meta_info()["cached_tokens"] >= len(p) - 1 for r, p in zip(reqs, prompts))
    if name == "no-radix-cache":
        assert stats["cache_hit_rate"] == 0
    if name in ("tiny-pool", "hicache-tiny-pool", "hicache-write-back-pages"):
        assert stats["num_preemptions"] > 0 and stats["evicted_tokens"] > 0
    if name.startswith("hicache"):
        assert stats["host_hit_tokens"] + stats["swapped_in_tokens"] > 0
    # No drafting assertion here: whether drafts pay is priced from measured step times, and for
    # a 2-layer model verifying a batch of 12 can cost more than it saves (it declined in one CI
    # run). The default model's runs below and tests/engine/test_speculative.py exercise drafts.


@pytest.mark.parametrize(
    "name",
    ["default", "no-radix-cache", "tiny-chunks", "tiny-pool", "hicache-tiny-pool", "speculative"],
)
def test_default_model_matches_transformers(default_case, name):
    folder, prompts, expected = default_case
    _, stats = _run_twice(folder, prompts, expected, CONFIGS[name])
    if name in ("tiny-pool", "hicache-tiny-pool"):
        assert stats["num_preemptions"] > 0 and stats["evicted_tokens"] > 0
    if name == "hicache-tiny-pool":
        assert stats["swapped_out_tokens"] > 0 and stats["swapped_in_tokens"] > 0
    if name == "speculative":
        # how much is drafted is priced from measured step times: on a loaded machine (a clean
        # clone's CI run beside other jobs) it fell to nothing once, so only that the mean is a
        # mean is held here; tests/engine/test_speculative.py holds that drafts are accepted
        assert stats["spec_accept_length"] >= 1


@pytest.fixture(scope="module")
def packed_alone(default_model_dir):
    """The default model served as its GGUF stores it (packed Q4_1, the defaults): each prompt's
    greedy tokens computed alone on a flushed cache, the answer every other way must give."""
    from transformers import AutoTokenizer

    prompts = shared_prefix_prompts(AutoTokenizer.from_pretrained(default_model_dir))
    scheduler = make_scheduler("default", attention_backend="auto", max_total_tokens=4096)
    assert scheduler.runner.quant.name == "gguf"
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    alone = []
    for prompt in prompts:
        assert scheduler.flush_cache()
        alone += run_in_process(scheduler, [[prompt]], params)
    return prompts, alone


@pytest.mark.parametrize("name", ["default", "tiny-chunks"])
def test_the_packed_default_model_answers_alike_cold_warm_and_chunked(packed_alone, name):
    """Quantized weights are not transformers' exact tokens, but the cache still never changes
    the answer: grouped linears compute each row alone and a step with prompt rows attends each
    in one order (`rows_exact`), so a prompt whose prefix another prompt left cached, sent again
    whole from the cache, or prefilled in chunks of 5 gets the tokens it gets on a flushed cache
    (a split prefix changed 4 of 6 short chat answers before). Decode steps keep their
    batch-sized split: batched beside others, a request's bits may still move."""
    prompts, alone = packed_alone
    settings = {"attention_backend": "auto", "max_total_tokens": 4096, **CONFIGS[name]}
    scheduler = make_scheduler("default", **settings)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    for i, (prompt, want) in enumerate(zip(prompts, alone)):
        first = run_in_process(scheduler, [[prompt]], params)  # the others' prefixes cached
        again = run_in_process(scheduler, [[prompt]], params)  # itself cached
        assert first == again == [want], f"prompt {i}"
    assert scheduler.stats()["cache_hit_rate"] > 0.5
