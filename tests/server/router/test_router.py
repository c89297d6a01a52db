"""Data parallelism with real processes: `radixrt router` in front of `radixrt serve` workers on
the tiny model, `serve --dp-size` with the HTTP gateway in front, salts apart, a fleet drained by
SIGTERM, and a worker that answers garbage."""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack, contextmanager

import msgpack
import psutil
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

import radixrt as rt
from radixrt.client.endpoint import RequestOptions
from radixrt.client.launcher import free_port
from radixrt.client.transport import RemoteError

from helpers import (
    assert_bad_frames_get_their_errors,
    hf_greedy,
    kill_a_streaming_client,
    launch_runtime,
    shared_prefix_prompts,
)
from ownership import assert_no_leak
from timeouts import REPLY_TIMEOUT_S

GREEDY = {"temperature": 0, "ignore_eos": True}


def _worker(tiny_model_dir, port: int | None = None, **kw) -> rt.Runtime:
    return launch_runtime(tiny_model_dir, **({"zmq_port": port} if port else {}), **kw)


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


def test_router_metrics_over_http_join_the_workers(workers):
    """`--metrics-port`: the workers' series, each labelled with its worker, then the router's."""
    port = free_port()
    with router_process([w.url for w in workers], "--metrics-port", str(port)) as endpoint:
        endpoint.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, **GREEDY})
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=REPLY_TIMEOUT_S) as reply:
            text = reply.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    workers_seen = {s.labels["worker"] for s in families["radixrt_num_requests_running"].samples}
    assert workers_seen == {"0", "1"}
    assert families["radixrt_router_workers_alive"].samples[0].value == 2
    routed = sum(s.value for s in families["radixrt_router_requests"].samples)
    assert routed >= 1
    model = workers[0].model_info["model"]
    assert all(s.labels["model_name"] == model for f in families.values() for s in f.samples)


def test_round_robin_and_shortest_queue(workers):
    urls = [w.url for w in workers]
    with router_process(urls, "--router-policy", "round-robin") as rr:
        before = _served(rr)
        for i in range(4):
            rr.generate(input_ids=[5, 6, 7, i + 8], sampling_params={**GREEDY, "max_new_tokens": 2})
        assert [a - b for a, b in zip(_served(rr), before)] == [8, 8]
        assert rr.stats()["routed_by_round_robin"] == 4
    with router_process(urls, "--router-policy", "shortest-queue") as sq:
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
    flags = ("--router-balance-abs-threshold", "2", "--router-balance-rel-threshold", "1.5")
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
        with router_process([a.url, b.url], "--router-policy", "round-robin") as r:
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
        # `--flag=value`: a Z85 key may start with "-", which argparse would take for a flag
        flags = (
            "--worker-api-key",
            "worker-key",
            f"--worker-curve-server-key={zmq.curve_public(worker_secret.encode()).decode()}",
        )
        router_public = zmq.curve_public(router_secret.encode()).decode()
        env_flags = ("--api-key", "router-key", f"--curve-secret-key={router_secret}")
        with router_process(
            [w.url], *flags, *env_flags, api_key="router-key", curve_server_key=router_public
        ) as r:
            out = r.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 3})
            assert len(out["output_ids"]) == 3
            wrong = rt.RuntimeEndpoint(r.url, api_key="worker-key", curve_server_key=router_public)
            with pytest.raises(PermissionError):
                wrong.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
            wrong.close()


def test_a_tenant_sees_no_server_path_through_a_router(workers, tiny_model_dir):
    """Without a key file the router asks its (keyless) workers as the admin, so it shows a
    tenant's key (`--api-key` beside an admin key: the default tenant's) the worker's answer
    without the server's paths; the admin's key sees them."""
    keys = ("--api-key", "tenant-key", "--admin-api-key", "admin-key")
    with router_process([w.url for w in workers], *keys, api_key="tenant-key") as tenant:
        info = tenant.model_info
        assert info["model"] == tiny_model_dir.name and "model_path" not in info
        admin = rt.RuntimeEndpoint(tenant.url, api_key="admin-key", timeout=REPLY_TIMEOUT_S)
        try:
            assert admin.model_info["model_path"] == workers[0].model_info["model_path"]
        finally:
            admin.close()


def test_serve_dp_size_with_the_http_gateway(tiny_model_dir):
    from openai import OpenAI

    with launch_runtime(tiny_model_dir, http=True, dp_size=2) as fleet:
        client = OpenAI(base_url=f"{fleet.http_url}/v1", api_key="none")
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
        with urllib.request.urlopen(f"{fleet.http_url}/metrics", timeout=REPLY_TIMEOUT_S) as r:
            text = r.read().decode()  # the gateway's counts, then the router's joined text
        assert "radixrt_http_requests_total{" in text and 'worker="1"' in text
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


def _fleet(tiny_model_dir, **kw) -> rt.Runtime:
    return launch_runtime(tiny_model_dir, dp_size=2, **kw)


def test_salts_are_apart_through_a_dp_size_fleet(tiny_model_dir):
    """The same prompt under a second salt is matched nowhere: not at the worker (no cached
    tokens) and not in the router's trees (no route by match), while under its own salt it is."""
    prompt = [random.Random(3).randrange(3, 49152) for _ in range(64)]
    params = {**GREEDY, "max_new_tokens": 2}
    with _fleet(tiny_model_dir) as fleet:

        def run(salt: str) -> dict:
            options = RequestOptions(cache_salt=salt)
            return fleet.generate(input_ids=prompt, sampling_params=params, options=options)

        def matched() -> int:
            return fleet.stats()["routed_by_match"]

        start = matched()
        assert run("a")["meta_info"]["cached_tokens"] == 0
        assert run("a")["meta_info"]["cached_tokens"] >= 60
        assert matched() == start + 1
        for salt in ("b", "c"):
            assert run(salt)["meta_info"]["cached_tokens"] == 0
        stats = fleet.stats()
        assert stats["routed_by_match"] == start + 1, "a match counted across salts"
        assert sum(w["router_namespaces"] for w in stats["workers"]) == 3
        _assert_no_leak(fleet)


def test_sigterm_drains_a_dp_size_fleet(tiny_model_dir):
    """SIGTERM to `serve --dp-size 2`: the request in flight finishes, new ones get `draining`,
    and the fleet (which exits 0 only when its workers did) and its workers all exit."""
    fleet = _fleet(tiny_model_dir)
    try:
        family = psutil.Process(fleet._proc.pid).children(recursive=True)
        assert len(family) >= 2
        # long enough to be in flight at SIGTERM, short enough to finish within the 30 s drain
        # timeout on a loaded 2-core machine (600 did not, once)
        params = {**GREEDY, "max_new_tokens": 200}
        stream = fleet.generate(input_ids=[5, 6, 7, 8], sampling_params=params, stream=True)
        next(stream)
        fleet._proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not fleet.stats()["draining"] and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(RemoteError) as refused:
            fleet.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
        assert refused.value.code == "draining"
        final = [chunk for chunk in stream if chunk["finished"]]
        assert len(final[0]["output_ids"]) == 200
        assert fleet._proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(family, timeout=20)
        assert not alive, f"left behind: {alive}"
    finally:
        fleet.shutdown()


# What a broken worker answers: frames that are not maps, maps the router cannot read, and for
# each generate, one reply that is a map with a field of the wrong type.
NOT_MAPS = [b"\xc1", msgpack.packb([1, 2]), msgpack.packb(7), msgpack.packb(None)]
BAD_MAPS = [
    {"rid": [1]},
    {"rid": {"a": 1}},
    {"no": "rid"},
    {"rid": "ping", "result": [1]},
    {"rid": "ping", "result": {"server_id": 5}},
    {"rid": "ping", "error": "nope"},
    {"rid": "ping", "error": {"code": "unauthorized", "message": "a refusal is no pong"}},
    {"rid": "stats-self", "result": "nope"},
    {"rid": "model-info-self", "result": None},
    {"rid": "gather-0", "result": [1]},
]
BAD_GENERATE_REPLIES = [
    {"error": "boom"},
    {"error": {"code": 5, "message": "x"}},
    {"finished": "yes"},
    {"finished": True, "output_ids": "abc"},
    {"finished": True, "output_ids": [1, None]},
]


@contextmanager
def garbage_worker():
    """A fake worker, a real ROUTER socket on a thread: each ping gets every kind of garbage,
    then a good pong (so the router keeps it in rotation); a generate gets one malformed reply;
    a stats its result as a list; any other op `true`. Yields its URL."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    replies = itertools.cycle(BAD_GENERATE_REPLIES)

    def answer(identity: bytes, msg: dict) -> None:
        rid, op = msg.get("rid"), msg.get("op")
        if op == "ping":
            sock.send_multipart([identity, msgpack.packb({"rid": rid, "result": "nope"})])
            for frame in NOT_MAPS + [msgpack.packb(m) for m in BAD_MAPS]:
                sock.send_multipart([identity, frame])
            reply = {"rid": rid, "result": {"server_id": "fake"}}
        elif op == "generate":
            reply = {"rid": rid, **next(replies)}
        elif op in ("stats", "model_info"):
            reply = {"rid": rid, "result": [1, 2]}
        else:
            reply = {"rid": rid, "result": True}
        sock.send_multipart([identity, msgpack.packb(reply)])

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                identity, frame = sock.recv_multipart()
                answer(identity, msgpack.unpackb(frame, raw=False))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()
        ctx.term()


def test_a_worker_answering_garbage_never_stops_the_router(workers):
    """Each malformed generate reply fails its request with `internal_error`; everything else
    the fake sends is dropped; the real worker's requests, and the router's ops, go on."""
    real = workers[0]
    with (
        garbage_worker() as fake,
        router_process([fake, real.url], "--router-policy", "round-robin") as r,
    ):
        codes = []
        for i in range(2 * len(BAD_GENERATE_REPLIES)):  # in turn: the fake, then the real one
            try:
                out = r.generate(
                    input_ids=[5, 6, 7, 9 + i], sampling_params=GREEDY | {"max_new_tokens": 2}
                )
                codes.append(len(out["output_ids"]))
            except RemoteError as e:
                assert "malformed" in str(e)
                codes.append(e.code)
        assert codes == ["internal_error", 2] * len(BAD_GENERATE_REPLIES)
        time.sleep(1.5)  # another round of pings and garbage
        stats = r.stats()
        assert [w["alive"] for w in stats["workers"]] == [True, True]
        assert stats["workers"][1]["total_tokens"] == 2048  # the real worker's stats stand
        assert r.flush_cache()
        assert_no_leak(real)


@contextmanager
def last_words_worker(url: str, chunks: int):
    """A fake worker, a real ROUTER socket on a thread, that streams one generate's `chunks`
    replies and its final one, then closes at once, as a drained worker exits after its last
    request. Pings get a pong with a server_id of its own; other ops an empty map."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if not sock.poll(50):
                continue
            identity, frame = sock.recv_multipart()
            msg = msgpack.unpackb(frame, raw=False)
            rid, op = msg.get("rid"), msg.get("op")
            if op == "generate":
                for i in range(chunks):
                    reply = {"rid": rid, "finished": False, "output_ids": list(range(i + 1))}
                    sock.send_multipart([identity, msgpack.packb(reply)])
                final = {"rid": rid, "finished": True, "output_ids": list(range(chunks + 1))}
                sock.send_multipart([identity, msgpack.packb(final)])
                done.set()
            elif op == "ping":
                pong = {"rid": rid, "result": {"server_id": f"fake-{id(sock)}"}}
                sock.send_multipart([identity, msgpack.packb(pong)])
            elif op != "abort":
                sock.send_multipart([identity, msgpack.packb({"rid": rid, "result": {}})])
        sock.close(linger=1000)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
        ctx.term()


def test_a_worker_that_exits_after_its_last_reply_is_not_a_loss(tmp_path):
    """The router reads what a worker sent before its connection dropped ahead of the drop,
    even when the poll saw the drop first: every stream ends with its final chunk, never with
    `worker_lost` (a drained fleet's last request failed this way, once in a CI run). Each fake
    exits after one request and a successor comes up at its address, which the router finds."""
    url = f"ipc://{tmp_path}/worker.sock"
    chunks = 400
    with ExitStack() as stack:
        stack.enter_context(last_words_worker(url, chunks))
        r = stack.enter_context(router_process([url]))
        for attempt in range(8):
            if attempt:
                stack.enter_context(last_words_worker(url, chunks))
                deadline = time.monotonic() + 10
                while not r.stats()["workers"][0]["alive"] and time.monotonic() < deadline:
                    time.sleep(0.05)
            stream = r.generate(input_ids=[5, 6], sampling_params=GREEDY, stream=True)
            finals = [c for c in stream if c["finished"]]
            assert len(finals[0]["output_ids"]) == chunks + 1
