"""Tenants, salts, priorities, deadlines, limits and drain on real runtime processes (tiny model)."""

from __future__ import annotations

import json
import random
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from functools import partial

import pytest

import radixrt as rt
from radixrt.client.endpoint import RequestOptions
from radixrt.client.transport import RemoteError

from helpers import launch_runtime
from ownership import assert_no_leak, wait_idle
from timeouts import REPLY_TIMEOUT_S

ADMIN_KEY = "admin-key"  # --api-key and --admin-api-key: the default tenant, and the admin
KEYS = {"alice": "alice-key", "bob": "bob-key"}
ENDLESS = {"max_new_tokens": 100000, "temperature": 0, "ignore_eos": True}
# long, yet within the tiny model's context: two run at once (an endless one reserves the pool)
LONG = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _error_code(call) -> str:
    with pytest.raises(RemoteError) as info:
        call()
    return info.value.code


@pytest.fixture(scope="module")
def tenants(runtimes, tiny_model_dir, tmp_path_factory):
    """A runtime with two tenants besides the default one, and small per-tenant limits."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# tenant:key\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        max_total_tokens=4096,
        api_key=ADMIN_KEY,
        admin_api_key=ADMIN_KEY,
        api_key_file=str(key_file),
        max_inflight_per_tenant=2,
        max_queued_tokens_per_tenant=1000,
    ) as r:
        yield r


def _endpoint(runtime, tenant: str, **options) -> rt.RuntimeEndpoint:
    return rt.RuntimeEndpoint(runtime.url, api_key=KEYS[tenant], timeout=REPLY_TIMEOUT_S, **options)


def test_a_tenants_prefix_is_cached_only_for_that_tenant(tenants):
    alice, bob = _endpoint(tenants, "alice"), _endpoint(tenants, "bob")
    prompt, params = _prompt(48, seed=1), {"max_new_tokens": 2}

    def cached(endpoint, **options) -> int:
        out = endpoint.generate(input_ids=prompt, sampling_params=params, **options)
        return out["meta_info"]["cached_tokens"]

    try:
        assert cached(alice) == 0
        assert cached(bob) == 0, "bob's request reused alice's prefix"
        assert cached(tenants) == 0, "the default tenant reused alice's prefix"
        assert cached(alice) == len(prompt) - 1
        assert cached(bob) == len(prompt) - 1
        salted = RequestOptions(cache_salt="s1")
        assert cached(alice, options=salted) == 0
        assert cached(alice, options=salted) == len(prompt) - 1
        assert cached(alice, options=RequestOptions(cache_salt="s2")) == 0
        assert cached(bob, options=salted) == 0, "one salt in two tenants is two namespaces"
        with _endpoint(tenants, "alice", cache_salt="s1") as backend:  # a DSL backend option
            assert cached(backend) == len(prompt) - 1
        stats = tenants.stats()
        assert stats["tenants"]["alice"]["cached_prompt_tokens"] == 3 * (len(prompt) - 1)
        assert stats["tenants"]["bob"]["requests"] == 3
        assert_no_leak(tenants)
    finally:
        alice.close()
        bob.close()


def test_http_salt_and_bearer_tenant(tenants):
    prompt = _prompt(40, seed=2)
    url = f"http://127.0.0.1:{tenants.args.port}/v1/completions"

    def cached(key: str, **body) -> int:
        data = json.dumps({"prompt": prompt, "max_tokens": 1, **body}).encode()
        request = urllib.request.Request(
            url, data, {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        )
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
            return json.load(reply)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEYS["alice"], cache_salt="web") == 0
    assert cached(KEYS["bob"], cache_salt="web") == 0
    assert cached(KEYS["alice"], cache_salt="web") == len(prompt) - 1
    with pytest.raises(urllib.error.HTTPError) as info:
        cached("not-a-key")
    assert info.value.code == 401
    metrics_url = f"http://127.0.0.1:{tenants.args.port}/metrics"
    admin = urllib.request.Request(metrics_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(admin, timeout=REPLY_TIMEOUT_S) as reply:
        metrics = reply.read().decode()
    model = json.dumps(tenants.model_info["model"])
    assert (
        f'radixrt_tenant_cached_prompt_tokens_total{{model_name={model},tenant="alice"}}' in metrics
    )
    assert f'radixrt_tenant_requests_total{{model_name={model},tenant="bob"}}' in metrics
    assert_no_leak(tenants)


def test_rate_limits_refuse_one_tenant_only(tenants):
    alice, bob = _endpoint(tenants, "alice"), _endpoint(tenants, "bob")
    try:
        streams = [
            alice.generate(input_ids=_prompt(8, seed=i), sampling_params=LONG, stream=True)
            for i in range(2)
        ]
        for stream in streams:
            next(stream)
        third = partial(alice.generate, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})
        assert _error_code(third) == "rate_limited"
        assert (
            len(
                bob.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})[
                    "output_ids"
                ]
            )
            == 3
        )
        for stream in streams:
            stream.close()  # aborts the request
        wait_idle(tenants)
        too_long = partial(
            alice.generate, input_ids=_prompt(1200, seed=3), sampling_params={"max_new_tokens": 1}
        )
        assert _error_code(too_long) == "rate_limited"
        assert tenants.stats()["tenants"]["alice"]["rate_limited"] == 2
        assert_no_leak(tenants)
    finally:
        alice.close()
        bob.close()


def test_deadlines_end_requests_with_timeout_and_free_their_slots(tenants):
    alice = _endpoint(tenants, "alice")
    try:
        start = time.monotonic()
        endless = partial(
            alice.generate,  # noqa: E731
            input_ids=[5, 6, 7],
            sampling_params=ENDLESS,
            options=RequestOptions(timeout=0.5),
        )
        assert _error_code(endless) == "timeout"
        assert time.monotonic() - start < 5
        assert tenants.stats()["tenants"]["alice"]["timeouts"] == 1
        assert_no_leak(tenants)
    finally:
        alice.close()


@pytest.fixture(scope="module")
def busy(runtimes, tiny_model_dir):
    """A runtime that runs two requests at a time out of a small pool, with priority preemption."""
    with runtimes.lease(
        tiny_model_dir,
        max_total_tokens=384,
        max_running_requests=2,
        enable_priority_preemption=True,
    ) as r:
        yield r


def _run_all(endpoint, jobs: list[tuple[list[int], dict, int]]) -> list[dict]:
    """Send every (prompt, sampling params, priority) at once from its own thread; the results
    in order."""
    results: list[dict | None] = [None] * len(jobs)

    def run(i: int) -> None:
        prompt, params, priority = jobs[i]
        results[i] = endpoint.generate(
            input_ids=prompt, sampling_params=params, options=RequestOptions(priority=priority)
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=REPLY_TIMEOUT_S)
    assert all(r is not None for r in results)
    return results


def test_high_priority_ttft_is_a_third_of_low(busy):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    jobs = [(_prompt(16, seed=i), params, 10 if i % 4 == 2 else 0) for i in range(12)]
    results = _run_all(busy, jobs)
    ttft = {
        p: [r["meta_info"]["ttft"] for r, j in zip(results, jobs) if j[2] == p] for p in (0, 10)
    }
    high, low = statistics.median(ttft[10]), statistics.median(ttft[0])
    print(f"TTFT p50: high {high:.3f} s, low {low:.3f} s")
    assert high <= low / 3, (high, low)
    assert_no_leak(busy)


def test_priority_preemption_admits_a_high_request_into_a_full_pool(busy):
    low = {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}
    before = busy.stats()["priority_preemptions"]
    results: list[dict] = []
    lows = [
        threading.Thread(
            target=lambda i=i: results.append(
                busy.generate(input_ids=_prompt(40, seed=i), sampling_params=low)
            )
        )
        for i in range(2)
    ]
    for t in lows:
        t.start()
    while busy.stats()["running"] < 2:
        time.sleep(0.02)
    high = busy.generate(
        input_ids=_prompt(40, seed=9),
        sampling_params={"max_new_tokens": 80, "temperature": 0, "ignore_eos": True},
        options=RequestOptions(priority=5),
    )
    assert busy.stats()["priority_preemptions"] > before
    for t in lows:
        t.join(timeout=REPLY_TIMEOUT_S)
    assert len(results) == 2 and all(len(r["output_ids"]) == 100 for r in results)
    assert high["meta_info"]["ttft"] < min(r["meta_info"]["e2e_latency"] for r in results) / 2
    assert_no_leak(busy)


def test_sigterm_drains(tiny_model_dir):
    """SIGTERM: the running request finishes, new ones get `draining` (HTTP: 503 with
    Retry-After), and the process exits 0."""
    runtime = launch_runtime(
        tiny_model_dir,
        http=True,
    )
    try:
        params = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
        stream = runtime.generate(input_ids=[5, 6, 7, 8], sampling_params=params, stream=True)
        next(stream)
        runtime._proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not runtime.stats()["draining"] and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = partial(runtime.generate, input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
        assert _error_code(refused) == "draining"
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{runtime.http_url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S)
        assert info.value.code == 503 and info.value.headers["Retry-After"]
        final = [chunk for chunk in stream if chunk["finished"]]
        assert len(final[0]["output_ids"]) == 150
        assert runtime._proc.wait(timeout=60) == 0
    finally:
        runtime.shutdown()
