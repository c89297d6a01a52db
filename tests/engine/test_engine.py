"""Engine behaviour on real models: sampling, stop strings, n > 1, aborts, leaks, bad input."""

from __future__ import annotations

import random
import threading
import time

import pytest

import radixrt as rt

from ownership import assert_all_free, assert_slot_ownership
from timeouts import REPLY_TIMEOUT_S

GREEDY = {"temperature": 0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def engine(default_model_dir):
    with rt.Engine(
        model=str(default_model_dir),
        max_total_tokens=2048,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    ) as e:
        yield e


def _chat(engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def test_seeded_sampling_reproduces(engine):
    prompt = _chat(engine, "Tell me a story about a dragon.")
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 16, "seed": 1234}
    first, second = engine.generate(prompt, params), engine.generate(prompt, params)
    assert first["output_ids"] == second["output_ids"]
    other = engine.generate(prompt, {**params, "seed": 99})
    assert other["output_ids"] != first["output_ids"]


def test_top_k_one_equals_greedy(engine):
    prompt = _chat(engine, "Name three fruits.")
    greedy = engine.generate(prompt, GREEDY)
    top1 = engine.generate(
        prompt, {"temperature": 1.0, "top_k": 1, "max_new_tokens": 16, "seed": 5}
    )
    assert top1["output_ids"] == greedy["output_ids"]


def test_stop_string_spanning_tokens_is_trimmed(engine):
    prompt = _chat(engine, "What is the capital of France?")
    full = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24})
    ids = full["output_ids"]
    pieces = [engine.tokenizer.decode(ids[i : i + 1]) for i in range(len(ids))]
    # a stop string made of the end of token 2 and the start of token 3: it spans a boundary
    k = next(
        i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    out = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24, "stop": stop})
    expected = full["text"][: full["text"].index(stop)]
    assert out["text"] == expected
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_ids_and_eos(engine):
    prompt = _chat(engine, "Say hello.")
    full = engine.generate(prompt, {**GREEDY, "max_new_tokens": 32})
    assert full["meta_info"]["finish_reason"]["type"] == "stop"  # the model ends its turn with EOS
    target = full["output_ids"][2]
    out = engine.generate(prompt, {**GREEDY, "stop_token_ids": [target]})
    assert out["output_ids"] == full["output_ids"][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    forced = engine.generate(prompt, {**GREEDY, "max_new_tokens": 40, "ignore_eos": True})
    assert forced["meta_info"]["completion_tokens"] == 40
    assert forced["meta_info"]["finish_reason"]["type"] == "length"
    at_least = engine.generate(prompt, {**GREEDY, "max_new_tokens": 40, "min_new_tokens": 30})
    assert at_least["meta_info"]["completion_tokens"] >= 30


def test_n_samples_share_the_prompt_slots(engine):
    engine.flush_cache()
    prompt = _chat(engine, "Write about the ocean. " * 40)
    n_prompt = len(engine.tokenizer.encode(prompt))
    outs = engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "n": 4, "seed": 7})
    assert len(outs) == 4 and len({tuple(o["output_ids"]) for o in outs}) > 1
    stats = engine.stats()
    # one copy of the prompt plus each sample's own tokens; four copies would need > 4 * n_prompt
    assert stats["peak_used_tokens"] < n_prompt + 4 * (8 + 2)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 3 * (n_prompt - 1)


def test_logprobs(engine):
    prompt = _chat(engine, "Count to five.")
    out = engine.generate(
        prompt,
        {
            **GREEDY,
            "max_new_tokens": 4,
            "return_logprob": True,
            "top_logprobs_num": 3,
            "logprob_start_len": 0,
        },
    )
    meta = out["meta_info"]
    assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _ in meta["output_token_logprobs"])
    for (lp, tok), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy picks the top token
    n_prompt = meta["prompt_tokens"]
    # SGLang's convention: every prompt token from logprob_start_len, the first with None
    assert len(meta["input_token_logprobs"]) == n_prompt
    assert meta["input_token_logprobs"][0][0] is None
    assert all(lp <= 0 for lp, _ in meta["input_token_logprobs"][1:])


def test_invalid_input_raises_value_error(engine):
    with pytest.raises(ValueError):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(ValueError):
        engine.generate("hi", {"top_p": 0})
    with pytest.raises(ValueError):
        engine.generate("hi", {"max_new_tokens": "ten"})
    with pytest.raises(ValueError):
        engine.generate("hi", {"no_such_param": 1})
    with pytest.raises(ValueError):
        engine.generate(input_ids=[10] * 5000)  # longer than the pool/context
    with pytest.raises(ValueError):
        engine.generate(input_ids=[10**9])
    assert engine.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2


def test_no_leaks_after_mixed_traffic(tiny_model_dir):
    """Aborts, preemptions, n > 1 and stop strings, from several threads; then every slot is free."""
    rng = random.Random(0)
    with rt.Engine(
        model=str(tiny_model_dir),
        max_total_tokens=96,
        max_running_requests=6,
        chunked_prefill_size=16,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    ) as engine:
        rids: list[str] = []

        def client(i: int) -> None:
            for j in range(3):
                ids = [
                    [rng.randrange(3, 49152) for _ in range(rng.randrange(4, 30))] for _ in range(3)
                ]
                params = [
                    {
                        "max_new_tokens": rng.randrange(1, 40),
                        "temperature": rng.choice([0, 0.8]),
                        "n": rng.choice([1, 1, 3]),
                        "stop": rng.choice([[], [], [], ["a"], ["the", "\n"]]),
                    }
                    for _ in range(3)
                ]
                batch = [f"client{i}-call{j}-{k}" for k in range(3)]
                rids.extend(batch)
                engine.generate(input_ids=ids, sampling_params=params, rid=batch)

        def aborter() -> None:
            for _ in range(20):
                time.sleep(0.05)
                if rids:
                    engine.abort(rng.choice(rids))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)] + [
            threading.Thread(target=aborter)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = engine.stats()
        assert stats["running"] == stats["waiting"] == 0
        assert stats["num_preemptions"] > 0
        engine.check_invariants()
        assert_slot_ownership(engine.memory_snapshot())
        assert engine.flush_cache()
        engine.check_invariants()
        assert_all_free(engine.memory_snapshot())
        stats = engine.stats()
        assert stats["free_tokens"] == stats["total_tokens"]
        assert stats["cached_tokens"] == stats["protected_tokens"] == 0
