"""The host tier, the disk tier and swap preemption on real models and real server processes:
evicted prefixes come back without being recomputed, and the answers do not change."""

from __future__ import annotations

import random
import threading
import time

from helpers import (
    assert_tiers_free,
    hf_greedy,
    kill_a_streaming_client,
    launch_runtime,
    tier_engine,
)

GREEDY = {"temperature": 0, "ignore_eos": True}


def _chats(engine, conversations: list[list[int]], turns: int) -> list[list[dict]]:
    """Each conversation's turns, interleaved across conversations (so they evict each other):
    a turn's prompt is the conversation so far plus a new user message."""
    histories = [list(c) for c in conversations]
    results: list[list[dict]] = [[] for _ in conversations]
    for turn in range(turns):
        for i, history in enumerate(histories):
            history += [100 + turn, 200 + i, 300 + turn]  # the new user message
            out = engine.generate(
                input_ids=history, sampling_params={**GREEDY, "max_new_tokens": 8}
            )
            results[i].append(out)
            history += out["output_ids"]
    return results


def test_revisited_conversations_come_back_from_the_host(tiny_model_dir):
    """Four conversations whose histories do not fit the device pool together: with the tier, a
    revisited conversation's history comes back from the host; without, it is recomputed. The
    answers are the same."""
    rng = random.Random(0)
    conversations = [[rng.randrange(3, 49000) for _ in range(150)] for _ in range(4)]
    pool = {"max_total_tokens": 320, "chunked_prefill_size": 64}
    with tier_engine(tiny_model_dir, **pool) as engine:
        plain = _chats(engine, conversations, 3)
    for policy in ("write_through", "write_back"):
        tier = {
            "enable_hierarchical_cache": True,
            "hicache_ratio": 4,
            "hicache_write_policy": policy,
        }
        with tier_engine(tiny_model_dir, **pool, **tier) as engine:
            tiered = _chats(engine, conversations, 3)
            stats = engine.stats()
            assert_tiers_free(engine)
        assert [[o["output_ids"] for o in c] for c in tiered] == [
            [o["output_ids"] for o in c] for c in plain
        ], policy
        for chat in tiered:
            for turn in range(1, 3):
                previous = chat[turn - 1]["meta_info"]
                history = previous["prompt_tokens"] + previous["completion_tokens"]
                meta = chat[turn]["meta_info"]
                assert meta["cached_tokens"] >= 0.9 * history, (policy, turn, meta)
                assert meta["host_cached_tokens"] > 0, (policy, turn, meta)
        assert stats["host_hit_tokens"] > 0 and stats["storage_hit_tokens"] == 0
        assert stats["host_total_tokens"] == 4 * stats["total_tokens"]
    plain_cached = [c[t]["meta_info"]["cached_tokens"] for c in plain for t in (1, 2)]
    assert max(plain_cached) < 0.5 * 150  # without the tier, histories were recomputed


def test_swap_preemption_gives_the_same_answers_as_recompute(tiny_model_dir):
    """A pool too small for the batch forces retractions; with swap, the retracted requests'
    KV goes to the host and is loaded back at readmission. n > 1 and a constrained request
    included; greedy answers equal recompute preemption's."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    params = [{**GREEDY, "max_new_tokens": 40} for _ in prompts]
    params[1] = {**params[1], "n": 2}
    params[2] = {"temperature": 0, "max_new_tokens": 40, "regex": "(ab|cd)+[0-9]{3,30}"}
    pool = {"max_total_tokens": 128, "max_running_requests": 8, "chunked_prefill_size": 32}
    outputs, stats = {}, {}
    for mode in ("recompute", "swap"):
        with tier_engine(
            tiny_model_dir, **pool, enable_hierarchical_cache=True, preemption_mode=mode
        ) as engine:
            # the regex compiled first: a compile still running when the batch arrives would
            # admit the constrained request at a step set by the host's load, not by the pool
            engine.generate(input_ids=[5, 6, 7], sampling_params={**params[2], "max_new_tokens": 1})
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            samples = [s for o in outs for s in (o if isinstance(o, list) else [o])]
            outputs[mode] = [s["output_ids"] for s in samples]
            stats[mode] = engine.stats()
            assert_tiers_free(engine)
    assert outputs["swap"] == outputs["recompute"]
    for mode in ("recompute", "swap"):
        assert stats[mode]["num_preemptions"] > 0, mode
    assert stats["recompute"]["swapped_out_tokens"] == 0
    assert stats["swap"]["swapped_out_tokens"] > 0 and stats["swap"]["swapped_in_tokens"] > 0


def test_a_restarted_server_reads_a_seen_prompt_from_disk(default_model_dir, tmp_path):
    """The disk tier survives a restart: the second server answers a long, already seen prompt
    from storage, equal to transformers. Corrupt files are skipped, not fatal."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 49000) for _ in range(300)]
    expected = hf_greedy(default_model_dir, [prompt], 8)[0]
    tier = {
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": str(tmp_path),
        "max_total_tokens": 1024,
    }
    sampling = {**GREEDY, "max_new_tokens": 8}
    with tier_engine(default_model_dir, **tier) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=sampling)
    assert first["output_ids"] == expected and first["meta_info"]["cached_tokens"] == 0
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == len(prompt) // 64  # whole blocks of 64 tokens
    with tier_engine(default_model_dir, **tier) as engine:  # a restart
        second = engine.generate(input_ids=prompt, sampling_params=sampling)
        stats = engine.stats()
        assert_tiers_free(engine)
    meta = second["meta_info"]
    assert second["output_ids"] == expected
    assert meta["cached_tokens"] == meta["storage_cached_tokens"] == 256
    assert stats["storage_hit_tokens"] == 256
    for f in files:  # every block damaged: read, detected, dropped; the prompt is recomputed
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with tier_engine(default_model_dir, **tier) as engine:
        third = engine.generate(input_ids=prompt, sampling_params=sampling)
        rejected = engine.stats()["storage_rejected_blocks"]
        assert_tiers_free(engine)
    assert third["output_ids"] == expected and third["meta_info"]["cached_tokens"] == 0
    assert rejected == 1  # the first block's failed check ends the run of reads


def test_an_int8_restart_reuses_nothing_a_float32_run_wrote(tiny_model_dir, tmp_path):
    """The disk tier's fingerprint covers the quantization of the weights and of the KV: after
    a float32 run, an int8-weights server, an int8-KV one and an fp8-KV one on the same weights
    and directory each read no block (and write their own), while a float32 restart still reads
    the first run's."""
    prompt = [random.Random(4).randrange(3, 49000) for _ in range(200)]
    tier = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path)}
    sampling = {**GREEDY, "max_new_tokens": 4}
    blocks = len(prompt) // 64
    runs = {
        "float32": {},
        "int8": {"quantization": "int8"},
        "int8 KV": {"kv_cache_dtype": "int8"},
        "fp8 KV": {"kv_cache_dtype": "fp8_e4m3"},
        "again": {},
    }
    metas = {}
    for written, (run, settings) in enumerate(runs.items(), 1):
        with tier_engine(tiny_model_dir, **tier, **settings) as engine:
            metas[run] = engine.generate(input_ids=prompt, sampling_params=sampling)["meta_info"]
            stats = engine.stats()
        assert stats["storage_rejected_blocks"] == 0, run
        files = len(list(tmp_path.glob("*.safetensors")))
        assert files == min(written, len(runs) - 1) * blocks, run
    for run in list(runs)[:-1]:
        assert metas[run]["cached_tokens"] == metas[run]["storage_cached_tokens"] == 0, run
    assert metas["again"]["storage_cached_tokens"] == blocks * 64


def test_aborts_and_a_vanished_client_during_load_back_leak_nothing(tiny_model_dir):
    """Requests whose prefix sits on the host are aborted around their load-back, and a client
    is killed right after sending one: the server keeps serving and both pools come back free."""
    rng = random.Random(3)
    histories = [[rng.randrange(3, 49000) for _ in range(120)] for _ in range(4)]
    tier = {
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
        "max_total_tokens": 256,
        "chunked_prefill_size": 32,
    }
    with launch_runtime(tiny_model_dir, **tier) as r:
        sampling = {**GREEDY, "max_new_tokens": 4}
        r.generate(input_ids=histories, sampling_params=[sampling] * 4)  # all on the host now
        results = []

        def revisit(i: int) -> None:
            results.append(
                r.generate(input_ids=histories[i] + [7], sampling_params=sampling, rid=f"re{i}")
            )

        threads = [threading.Thread(target=revisit, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for i in range(4):
            time.sleep(0.01 * i)
            r.abort(f"re{i}")
        for t in threads:
            t.join()
        assert all(o["meta_info"]["finish_reason"]["type"] in ("abort", "length") for o in results)
        kill_a_streaming_client(r.url, histories[0] + [9], 100000)
        deadline = time.monotonic() + 15
        while r.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = r.stats()
        assert stats["running"] == stats["waiting"] == 0 and stats["host_hit_tokens"] > 0
        again = r.generate(input_ids=histories[1] + [7], sampling_params=sampling)
        assert len(again["output_ids"]) == 4  # still serving
        assert_tiers_free(r)
