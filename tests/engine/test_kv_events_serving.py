"""KV-cache events from a serving runtime (the tiny model): an indexer that knows only the events
holds exactly the pages the server holds, through stores, evictions from a small pool, host-tier
moves, salted namespaces, its own restart (caught up by replay) and a flush; a subscriber that
never reads does not hold serving back."""

from __future__ import annotations

import json
import os
import random

import pytest

import radixrt as rt

from kv_subscriber import Subscriber, held_pages
from timeouts import REPLY_TIMEOUT_S

PAGE = 4
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
SEED = os.environ.get("PYTHONHASHSEED", "")  # the runtime inherits it: its hash seed

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-events")
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{folder}/events",
        "replay_endpoint": f"ipc://{folder}/replay",
        "topic": "kv@pod-0@tiny",
    }
    with rt.Engine(
        model=str(tiny_model_dir),
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        max_total_tokens=384,
        page_size=PAGE,
        enable_hierarchical_cache=True,
        hicache_ratio=1.0,
        kv_events_config=json.dumps(config),
    ) as engine:
        yield engine, config


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that share a few system prefixes, each with its own tail."""
    systems = [[rng.randrange(100, 40_000) for _ in range(24)] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(100, 40_000) for _ in range(40)] for _ in range(n)]


def _serve(engine, prompts: list[list[int]], salt: str | None = None) -> None:
    options = rt.RequestOptions(cache_salt=salt) if salt else None
    for ids in prompts:
        engine.generate(input_ids=ids, sampling_params=GREEDY, options=options)


def _assert_index_matches(engine, sub: Subscriber) -> dict:
    snapshot = engine.memory_snapshot()  # nothing runs: the tree stays as it is now
    sub.drain()
    assert sub.index.held == held_pages(snapshot, PAGE, SEED)
    return snapshot


def test_an_indexer_holds_what_the_server_holds_through_restart_and_flush(served):
    engine, config = served
    rng = random.Random(0)
    assert engine.flush_cache()
    sub = Subscriber(config["endpoint"], config["replay_endpoint"])
    stuck = Subscriber(config["endpoint"], RCVHWM=1, RCVBUF=4096)  # reads nothing, ever
    try:
        sub.drain()  # the flush's batch, or a replay of all batches so far for a gap
        _serve(engine, _prompts(rng, 12))
        _serve(engine, _prompts(rng, 3), salt="tenant-a")
        _assert_index_matches(engine, sub)
        stats = engine.stats()
        assert stats["evicted_tokens"] > 0 and stats["host_used_tokens"] > 0
        assert sub.index.held["CPU"] and sub.index.held["GPU"]
        assert sub.topics == {config["topic"].encode()}

        sub.close()  # the indexer restarts while the server goes on
        _serve(engine, _prompts(rng, 6))
        restarted = Subscriber(config["endpoint"], config["replay_endpoint"])
        restarted.index = sub.index
        missed = restarted.replay(sub.index.last_seq + 1)
        assert missed > 0
        _assert_index_matches(engine, restarted)

        assert engine.flush_cache()
        _assert_index_matches(engine, restarted)
        assert restarted.index.held == {"GPU": set(), "CPU": set()}
        restarted.close()
    finally:
        stuck.close()


def test_metrics_count_published_and_dropped_batches(served):
    engine, _ = served
    _serve(engine, _prompts(random.Random(1), 2))
    text = engine.metrics()
    published = [line for line in text.splitlines() if line.startswith("radixrt_kv_event_batches")]
    assert published and float(published[0].rsplit(" ", 1)[1]) > 0
    assert "radixrt_kv_event_dropped_batches_total" in text
    assert engine.stats()["kv_event_batches"] > 0


def _sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_metrics_carry_the_names_endpoint_pickers_read(served):
    """vLLM's names for queue depth, running requests, KV usage and adapters in use, beside
    radixrt's (the Gateway API Inference Extension's defaults)."""
    engine, _ = served
    text = engine.metrics()
    for vllm, mine in [
        ("vllm:num_requests_waiting", "radixrt_num_requests_waiting"),
        ("vllm:num_requests_running", "radixrt_num_requests_running"),
        ("vllm:kv_cache_usage_perc", "radixrt_kv_usage_ratio"),
        ("vllm:gpu_cache_usage_perc", "radixrt_kv_usage_ratio"),
    ]:
        assert _sample(text, vllm) == _sample(text, mine)
    assert "vllm:lora_requests_info{" in text and "max_lora=" in text
    assert 'running_lora_adapters=""' in text


def _stored_events(engine, config, salt: str | None) -> list:
    """The pages one prompt stores, as a fresh subscriber reads them (after a flush)."""
    assert engine.flush_cache()
    sub = Subscriber(config["endpoint"])
    try:
        sub.drain()
        _serve(engine, _prompts(random.Random(7), 1), salt=salt)
        sub.drain()
        return sub.index.stored
    finally:
        sub.close()


def test_a_tenants_pages_go_out_without_their_token_ids(served):
    """A salted prompt's pages are published with their block hashes only: the token ids
    would spell it to any subscriber. Shared pages keep their ids (vLLM's schema)."""
    engine, config = served
    shared = _stored_events(engine, config, None)
    assert shared and all(len(e.token_ids) == PAGE * len(e.block_hashes) for e in shared)
    salted = _stored_events(engine, config, "tenant-b")
    assert salted and all(e.block_hashes and e.token_ids == [] for e in salted)


def test_the_replay_socket_drops_huge_frames_before_holding_them(served):
    """8 frames of 128 MiB sent to the replay socket: each sender is dropped before the frame
    is allocated, so the runtime's memory stays put, and a replay still works after."""
    import psutil
    import zmq

    engine, config = served
    runtime = psutil.Process(engine._proc.pid)
    before = runtime.memory_info().rss
    ctx = zmq.Context.instance()
    huge = b"\0" * (128 << 20)
    for _ in range(8):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 2000)
        dealer.connect(config["replay_endpoint"])
        dealer.send_multipart([b"", huge])
        dealer.close()  # lingers until sent (or the connection drops)
    del huge
    _serve(engine, _prompts(random.Random(3), 1))
    grown = runtime.memory_info().rss - before
    assert grown < 64 << 20, f"the runtime grew {grown >> 20} MiB"
    sub = Subscriber(config["endpoint"], config["replay_endpoint"])
    try:
        assert sub.replay(0) > 0
    finally:
        sub.close()


def test_a_wildcard_kv_events_bind_needs_keys_or_the_opt_in(tiny_model_dir):
    """The publisher's sockets check no key: binding them beyond loopback on a server without
    keys is refused at start, in one line, before the model loads."""
    import subprocess
    import sys

    from radixrt.client.launcher import free_port

    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}"}
    for extra in ({}, {"replay_endpoint": f"tcp://0.0.0.0:{free_port()}"}):
        if extra:
            config = {**config, "endpoint": "tcp://127.0.0.1:1", **extra}
        run = subprocess.run(
            [sys.executable, "-m", "radixrt", "serve", "--model", str(tiny_model_dir),
             "--disable-http", "--kv-events-config", json.dumps(config)],
            capture_output=True, text=True, timeout=REPLY_TIMEOUT_S,
        )  # fmt: skip
        assert run.returncode != 0 and "refusing to publish KV events" in run.stderr
