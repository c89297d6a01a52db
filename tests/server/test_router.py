"""Data parallelism with real processes: `radixrt router` in front of `radixrt serve` workers on
the tiny model, and `serve --dp-size` with the HTTP gateway in front."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import psutil
import pytest
import zmq

import radixrt as rt
from radixrt.client.launcher import free_port
from radixrt.client.transport import RemoteError

from helpers import (
    assert_bad_frames_get_their_errors,
    hf_greedy,
    kill_a_streaming_client,
    shared_prefix_prompts,
)
from timeouts import REPLY_TIMEOUT_S

GREEDY = {"temperature": 0, "ignore_eos": True}


def _worker(tiny_model_dir, port: int | None = None, **kw) -> rt.Runtime:
    return rt.Runtime(
        model=str(tiny_model_dir),
        max_total_tokens=2048,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        **({"port": port} if port else {}),
        **kw,
    )


@contextmanager
def router_process(workers: list[str], *flags: str, api_key: str | None = None, **endpoint_kw):
    """`radixrt router` over `workers`; yields an endpoint once every worker is in rotation."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixrt", "router", "--port", str(port), "--log-level", "warning"]
    for url in workers:
        cmd += ["--worker", url]
    proc = subprocess.Popen([*cmd, *flags])
    endpoint = rt.RuntimeEndpoint(
        f"tcp://127.0.0.1:{port}", api_key=api_key, timeout=REPLY_TIMEOUT_S, **endpoint_kw
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the router exited"
            try:
                stats = endpoint.client.call("stats", timeout=1)
            except (TimeoutError, RemoteError):
                continue
            if all(w["alive"] for w in stats["workers"]):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the workers did not join the router")
        yield endpoint
    finally:
        endpoint.close()
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    with _worker(tiny_model_dir) as a, _worker(tiny_model_dir) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def router(workers):
    with router_process([w.url for w in workers]) as endpoint:
        yield endpoint


def _served(router) -> list[int]:
    """Prompt tokens each worker has been sent so far (its own count)."""
    return [w["prompt_tokens_total"] for w in router.stats()["workers"]]


def _assert_no_leak(router) -> None:
    deadline = time.monotonic() + 20
    while (stats := router.stats())["running"] + stats["waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    router.check_invariants()
    assert router.flush_cache()
    stats = router.stats()
    assert stats["free_tokens"] == stats["total_tokens"] > 0
    assert all(w["free_tokens"] == w["total_tokens"] for w in stats["workers"])


def test_a_fleet_gives_transformers_tokens_cold_and_warm(router, workers, tiny_model_dir):
    prompts = shared_prefix_prompts(workers[0].tokenizer, 12)
    expected = hf_greedy(tiny_model_dir, prompts, 8)
    params = {**GREEDY, "max_new_tokens": 8}
    for _ in ("cold", "warm"):
        outs = router.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    _assert_no_leak(router)


def test_next_turns_land_where_their_history_is(router, workers):
    rng = random.Random(1)
    vocab = "river stone cloud paper garden window silver market winter signal forest".split()
    firsts = [" ".join(rng.choice(vocab) for _ in range(60)) + f" Question {i}:" for i in range(6)]
    before = router.stats()
    turn1 = router.generate(firsts, [{**GREEDY, "max_new_tokens": 6}] * 6)
    spread = _served(router)
    # the second turn resends the history: the first turn's prompt and answer
    tokenizer = workers[0].tokenizer
    seconds = [
        tokenizer.encode(text, add_special_tokens=False) + out["output_ids"] + [11, 12, 13]
        for text, out in zip(firsts, turn1)
    ]
    turn2 = router.generate(
        input_ids=seconds, sampling_params=[{**GREEDY, "max_new_tokens": 4}] * 6
    )
    for ids, out in zip(seconds, turn2):
        assert out["meta_info"]["cached_tokens"] >= 0.9 * (len(ids) - 3)
    after = router.stats()
    assert after["routed_by_match"] - before["routed_by_match"] >= 6
    assert all(spread[i] > before["workers"][i]["prompt_tokens_total"] for i in range(2)), (
        "new conversations should spread over both workers"
    )
    _assert_no_leak(router)


def test_round_robin_and_shortest_queue(workers):
    urls = [w.url for w in workers]
    with router_process(urls, "--policy", "round-robin") as rr:
        before = _served(rr)
        for i in range(4):
            rr.generate(input_ids=[5, 6, 7, i + 8], sampling_params={**GREEDY, "max_new_tokens": 2})
        assert [a - b for a, b in zip(_served(rr), before)] == [8, 8]
        assert rr.stats()["routed_by_round_robin"] == 4
    with router_process(urls, "--policy", "shortest-queue") as sq:
        before = _served(sq)
        # all at once: each goes where fewer are in flight, so they split evenly
        sq.generate(
            input_ids=[[5, 6, 7, i + 8] for i in range(6)],
            sampling_params={**GREEDY, "max_new_tokens": 200},
        )
        assert [a - b for a, b in zip(_served(sq), before)] == [12, 12]
        assert sq.stats()["router_policy"] == "shortest-queue"


def test_a_swamped_worker_sends_load_to_the_idle_one(workers):
    """Every request shares one long prefix, so by match all would go to one worker; past the
    balance thresholds the idle worker takes them whatever the match."""
    shared = [random.Random(2).randrange(3, 49152) for _ in range(100)]
    prompts = [shared + [i + 3] for i in range(12)]
    urls = [w.url for w in workers]
    flags = ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.5")
    with router_process(urls, *flags) as r:
        before = _served(r)
        r.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 100})
        got = [a - b for a, b in zip(_served(r), before)]
        stats = r.stats()
        assert min(got) >= 3 * 101, got
        assert stats["routed_by_match"] >= 1 and stats["routed_by_load"] >= 2


def test_garbage_frames_and_a_vanished_client(router, workers):
    assert_bad_frames_get_their_errors(router.url)
    kill_a_streaming_client(router.url, [5, 6, 7, 8], 1000)
    start = time.monotonic()
    while router.stats()["running"] and time.monotonic() - start < 15:
        time.sleep(0.2)
    assert time.monotonic() - start < 10, "the vanished client's request was not aborted"
    _assert_no_leak(router)


def test_a_killed_worker_loses_started_streams_only_and_rejoins(tiny_model_dir):
    """Each worker runs one request at a time: of the two sent to the killed worker, the one
    streaming ends with worker_lost, the one still waiting is re-sent and finishes elsewhere."""
    port = free_port()
    a = _worker(tiny_model_dir, port, max_running_requests=1)
    with _worker(tiny_model_dir, max_running_requests=1) as b:
        with router_process([a.url, b.url], "--policy", "round-robin") as r:
            results: dict[int, object] = {}

            def stream(i: int) -> None:
                try:
                    chunks = r.generate(
                        input_ids=[5, 6, 7, 8 + i],
                        sampling_params={**GREEDY, "max_new_tokens": 900},
                        stream=True,
                    )
                    results[i] = [c for c in chunks if c["finished"]][0]["output_ids"]
                except RemoteError as e:
                    results[i] = e.code

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
                time.sleep(0.05)  # in order: 0 and 2 to worker a, 1 and 3 to b
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # request 0 streams on a, request 2 waits
                stats = a.stats()
                if stats["waiting"] >= 1 and stats["generated_tokens"] > 10:
                    break
                time.sleep(0.02)
            time.sleep(0.2)  # its first tokens have reached the client through the router
            a._proc.kill()
            for t in threads:
                t.join(timeout=REPLY_TIMEOUT_S)
            assert not any(t.is_alive() for t in threads), "a client hangs"
            codes = [results[i] for i in range(4)]
            assert codes.count("worker_lost") == 1, codes
            assert sum(isinstance(c, list) and len(c) == 900 for c in codes) == 3
            stats = r.stats()
            assert [w["alive"] for w in stats["workers"]] == [False, True]
            assert stats["resent_requests"] == 1 and stats["lost_requests"] == 1
            a._finalizer()
            with _worker(tiny_model_dir, port):  # the same address again
                deadline = time.monotonic() + 30
                while not r.stats()["workers"][0]["alive"] and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert r.stats()["workers"][0]["alive"]
                outs = r.generate(
                    input_ids=[[5, 6, 7, 30 + i] for i in range(4)],
                    sampling_params={**GREEDY, "max_new_tokens": 2},
                )
                assert all(len(o["output_ids"]) == 2 for o in outs)


def test_api_key_and_curve_on_both_hops(tiny_model_dir):
    worker_secret, router_secret = (zmq.curve_keypair()[1].decode() for _ in range(2))
    with _worker(tiny_model_dir, api_key="worker-key", curve_secret_key=worker_secret) as w:
        flags = (
            "--worker-api-key",
            "worker-key",
            "--worker-curve-server-key",
            zmq.curve_public(worker_secret.encode()).decode(),
        )
        router_public = zmq.curve_public(router_secret.encode()).decode()
        env_flags = ("--api-key", "router-key", "--curve-secret-key", router_secret)
        with router_process(
            [w.url], *flags, *env_flags, api_key="router-key", curve_server_key=router_public
        ) as r:
            out = r.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 3})
            assert len(out["output_ids"]) == 3
            wrong = rt.RuntimeEndpoint(r.url, api_key="worker-key", curve_server_key=router_public)
            with pytest.raises(PermissionError):
                wrong.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
            wrong.close()


def test_serve_dp_size_with_the_http_gateway(tiny_model_dir):
    from openai import OpenAI

    http_port = free_port()
    with rt.Runtime(
        model=str(tiny_model_dir),
        dp_size=2,
        http_port=http_port,
        max_total_tokens=2048,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    ) as fleet:
        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=5,
            temperature=0,
        )
        assert reply.choices[0].message.content is not None
        stats = fleet.stats()
        assert stats["dp_size"] == 2 and [w["alive"] for w in stats["workers"]] == [True, True]
        assert stats["total_tokens"] == 2 * 2048
        family = psutil.Process(fleet._proc.pid).children(recursive=True)
        assert len(family) >= 3  # two workers and the gateway
    gone, alive = psutil.wait_procs(family, timeout=20)
    assert not alive, f"left behind: {alive}"


def test_a_killed_launcher_leaves_no_fleet_behind(tiny_model_dir):
    """SIGKILL gives rt.Runtime no chance to stop its fleet: the fleet, which watches its
    launcher, ends itself, and its workers, which watch the fleet, follow."""
    script = (
        "import os, radixrt as rt\n"
        f"r = rt.Runtime(model={str(tiny_model_dir)!r}, dp_size=2, max_total_tokens=1024,"
        " log_level='warning')\n"
        "print(r._proc.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    fleet = psutil.Process(int(launcher.stdout.readline()))
    family = [fleet, *fleet.children(recursive=True)]
    assert len(family) >= 3
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    gone, alive = psutil.wait_procs(family, timeout=20)
    assert not alive, f"left behind: {alive}"


def test_a_fork_runs_its_branches_on_the_worker_holding_its_prefix(router, workers):
    @rt.function
    def branches(s):
        s += "Colours of the sea, the sky and the stones on the shore, listed one by one:"
        forks = s.fork(3)
        forks += lambda i: f" ({i})" + rt.gen("item", max_tokens=4, temperature=0, ignore_eos=True)
        forks.join()

    before = router.stats()
    routed = branches.run(backend=router)
    direct = branches.run(backend=workers[0])
    assert routed["item"] == direct["item"] and len(routed["item"]) == 3
    after = router.stats()
    assert after["routed_by_pin"] - before["routed_by_pin"] == 3
    assert after["pins"] == 0  # joined: released at the worker
    _assert_no_leak(router)
