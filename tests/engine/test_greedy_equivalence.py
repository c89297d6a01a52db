"""Invariant 1: the cache never changes the answer (greedy == transformers, token for token)."""

from __future__ import annotations

import pytest

import radixrt as rt

from helpers import hf_greedy, shared_prefix_prompts
from timeouts import REPLY_TIMEOUT_S

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
    with rt.Engine(
        model=str(folder),
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        **{"max_total_tokens": 4096, **overrides},
    ) as engine:
        for attempt in ("cold", "warm"):
            outs = engine.generate(
                input_ids=prompts,
                sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
            )
            got = [o["output_ids"] for o in outs]
            mismatched = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
            assert not mismatched, (
                f"{attempt} run differs from transformers on prompts {mismatched}"
            )
        stats = engine.stats()
        engine.check_invariants()
        assert engine.flush_cache()
        engine.check_invariants()
        after = engine.stats()
        assert after["free_tokens"] == after["total_tokens"]
        assert after["host_used_tokens"] == 0
    return outs, stats


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
    outs, stats = _run_twice(folder, prompts, expected, CONFIGS[name])
    if name == "default":
        assert stats["cache_hit_rate"] > 0.5
        assert all(o["meta_info"]["cached_tokens"] >= len(p) - 1 for o, p in zip(outs, prompts))
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
        assert stats["spec_accept_length"] > 2
