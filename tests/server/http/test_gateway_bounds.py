"""The HTTP gateway is a client like any other (issue 39, item 4): a request that packs past the
runtime's frame limit is a 413 naming the limit and costs no one else their connection; one that
cannot be packed at all is a 400 and leaves nothing behind; one the runtime never answers is a
504 `timeout`; a caller's pins end with their lease. And the router's /metrics port cannot be
held by a slow client. Real processes and sockets throughout (the tiny random model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import radixrt as rt
from radixrt.client.transport import FrameTooLargeError, InvalidRequestError, RuntimeClient
from radixrt.server.front import CLIENT_SILENCE_S
from radixrt.server.http.gateway import REPLY_GRACE_S
from radixrt.server.router import metrics_http
from radixrt.server.tenants import KeyRing

from helpers import http_json
from timeouts import REPLY_TIMEOUT_S

ADMIN, ALICE, BOB = "admin-key", "alice-key", "bob-key"
FRAME_LIMIT = 64 << 10  # the runtime's --max-frame-bytes here (and so the gateway's body cap)
REQUEST_TIMEOUT_S = 15.0  # --http-request-timeout (the tests share two busy cores)
PIN_LEASE_S = 2.0  # --http-pin-lease
GREEDY = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        api_key_file=str(key_file),
        admin_api_key=ADMIN,
        max_total_tokens=4096,
        max_frame_bytes=FRAME_LIMIT,
        http_request_timeout=REQUEST_TIMEOUT_S,
        http_pin_lease=PIN_LEASE_S,
    ) as r:
        yield r


def _post(runtime, path: str, body: dict | bytes, key: str = ALICE, timeout=REPLY_TIMEOUT_S):
    """(status, parsed body) of one call; an error status is returned, not raised."""
    return http_json(f"{runtime.http_url}{path}", body, key=key, timeout=timeout)


def _gauges(runtime) -> dict[str, float]:
    """The gateway's own gauges from /metrics (the admin's key)."""
    request = urllib.request.Request(
        f"{runtime.http_url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
        text = reply.read().decode()
    names = ("radixrt_http_in_flight", "radixrt_http_pin_leases")
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(names)
    }


def _completion(prompt: str = "Hello", **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, **GREEDY, **fields}


# ---- the client side, no runtime needed --------------------------------------------------------
def test_client_refuses_unsendable_requests_before_registering_them():
    """Nothing is registered (or sent) for a request that cannot be packed or is too large."""
    client = RuntimeClient("tcp://127.0.0.1:9", max_frame_bytes=4096)  # nothing listens there
    try:
        with pytest.raises(InvalidRequestError, match="64 bits") as bad:
            client.submit(input_ids=[1, 2], sampling_params={"seed": 2**64})
        assert bad.value.code == "invalid_request"
        with pytest.raises(FrameTooLargeError, match="at most 4096 bytes") as big:
            client.submit(text="x" * 5000, sampling_params={})
        assert big.value.limit == 4096 and big.value.size > 5000
        with pytest.raises(InvalidRequestError):
            client.call("tokenize", timeout=1, text=2**70)
        assert client.in_flight == 0
    finally:
        client.close()


# ---- the router's /metrics port ------------------------------------------------------------------
@pytest.fixture
def metrics_port():
    server = metrics_http.serve_metrics("127.0.0.1", 0, "tcp://127.0.0.1:9", KeyRing())
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes `sock` (sending `trickle` a byte a second meanwhile)."""
    start = time.monotonic()
    sock.settimeout(1.0)
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except OSError:  # reset
            return time.monotonic() - start
        if trickle:
            try:
                sock.send(trickle)
            except OSError:
                return time.monotonic() - start
    raise AssertionError(f"the connection was still open after {seconds}s")


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def test_metrics_port_cuts_slow_clients(metrics_port):
    """A client that sends half a request line, one that trickles header bytes, and connections
    past MAX_CONNECTIONS are all cut; a plain request is answered meanwhile and after."""
    idle = socket.create_connection(("127.0.0.1", metrics_port))
    idle.sendall(b"GET /metr")
    trickler = socket.create_connection(("127.0.0.1", metrics_port))
    trickler.sendall(b"GET /metrics HTTP/1.1\r\n")
    assert _get(metrics_port, "/other") == 404  # served beside them
    assert _closed_within(idle, metrics_http.READ_TIMEOUT_S + 3) <= metrics_http.READ_TIMEOUT_S + 2
    elapsed = _closed_within(trickler, metrics_http.REQUEST_DEADLINE_S + 3, trickle=b"X")
    assert elapsed <= metrics_http.REQUEST_DEADLINE_S + 2
    held = [
        socket.create_connection(("127.0.0.1", metrics_port))
        for _ in range(metrics_http.MAX_CONNECTIONS)
    ]
    time.sleep(0.5)  # each is accepted and waits in its thread
    extra = socket.create_connection(("127.0.0.1", metrics_port))
    assert _closed_within(extra, 3) < 2  # full: closed at once
    for sock in [idle, trickler, extra, *held]:
        sock.close()
    time.sleep(0.5)
    assert _get(metrics_port, "/other") == 404


# ---- the gateway against a runtime ---------------------------------------------------------------
def test_a_body_that_packs_past_the_frame_limit_is_a_413_and_others_are_served(runtime):
    """JSON -> msgpack grows (a float is 9 bytes packed): a body under the cap packs past the
    frame limit. The gateway refuses it before sending, so its connection, which carries every
    caller's requests, is not dropped: a request in flight meanwhile finishes."""
    bias = {str(i): 0.5 for i in range(5000)}  # ~53 KB of JSON, ~70 KB packed
    body = json.dumps(_completion(logit_bias=bias)).encode()
    assert len(body) < FRAME_LIMIT
    slow: dict = {}
    other = threading.Thread(
        target=lambda: slow.update(
            zip(
                ("status", "body"),
                _post(runtime, "/v1/completions", _completion(max_tokens=16), BOB),
            )
        )
    )
    other.start()
    status, error = _post(runtime, "/v1/completions", body)
    other.join(REPLY_TIMEOUT_S)
    assert status == 413, error
    assert error["error"]["code"] == "invalid_request"
    assert f"at most {FRAME_LIMIT} bytes" in error["error"]["message"]
    assert slow["status"] == 200 and slow["body"]["choices"][0]["finish_reason"] == "length"
    assert _post(runtime, "/v1/completions", _completion(), BOB)[0] == 200
    # streamed and native bodies too
    status, _ = _post(runtime, "/v1/completions", {**json.loads(body), "stream": True})
    assert status == 413
    native = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "logit_bias": bias}}
    status, error = _post(runtime, "/generate", native)
    assert status == 413, error


def test_an_unpackable_request_is_a_400_and_leaves_no_entry(runtime):
    for path, body in [
        ("/v1/completions", _completion(seed=2**64)),
        ("/v1/completions", _completion(seed=2**64, stream=True)),
        ("/generate", {"text": "Hi", "sampling_params": {"seed": 2**64}}),
        ("/pin", {"pin_id": "p", "input_ids": [2**64]}),
    ]:
        status, error = _post(runtime, path, body)
        assert status == 400, (path, error)
        assert error["error"]["code"] == "invalid_request"
        assert "64 bits" in error["error"]["message"]
    assert _gauges(runtime) == {"radixrt_http_in_flight": 0, "radixrt_http_pin_leases": 0}
    assert _post(runtime, "/v1/completions", _completion())[0] == 200


def test_pins_are_each_callers_and_end_with_their_lease(runtime):
    prompt = {"text": "The capital of France is"}
    assert _post(runtime, "/v1/completions", _completion(prompt["text"]))[0] == 200  # cached
    status, pinned = _post(runtime, "/pin", {"pin_id": "fork", **prompt})
    assert status == 200 and pinned["pinned_tokens"] > 0 and pinned["lease_s"] == PIN_LEASE_S
    assert _post(runtime, "/pin", {"pin_id": "fork", **prompt})[0] == 400  # held already
    # Bob's own: the prompt cached under his tenant first (a pin of nothing is refused)
    assert _post(runtime, "/v1/completions", _completion(prompt["text"]), key=BOB)[0] == 200
    assert _post(runtime, "/pin", {"pin_id": "fork", **prompt}, key=BOB)[0] == 200
    assert _post(runtime, "/unpin", {"pin_id": "fork"}, key=BOB) == (200, {"success": True})
    assert _post(runtime, "/pin", {"pin_id": "x" * 1000, **prompt})[0] == 400  # id too long
    assert _gauges(runtime)["radixrt_http_pin_leases"] == 1
    time.sleep(PIN_LEASE_S + 2)  # the lease ends; the gateway unpins
    assert _gauges(runtime)["radixrt_http_pin_leases"] == 0
    assert runtime.memory_snapshot()["pinned_nodes"] == []
    assert _post(runtime, "/unpin", {"pin_id": "fork"}) == (200, {"success": False})


def test_a_client_holding_pins_keeps_its_connection_alive(runtime):
    """The runtime drops the pins of a client that pinged and then fell silent for 5 s, so a
    client (the gateway among them) pings while it holds pins: idle past that, the pin holds."""
    with rt.RuntimeEndpoint(runtime.url, api_key=ALICE, timeout=REPLY_TIMEOUT_S) as client:
        client.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        assert client.pin("idle", "The capital of France is") > 0
        time.sleep(CLIENT_SILENCE_S + 2)
        assert runtime.memory_snapshot()["pinned_nodes"] != []
        assert client.unpin("idle")


def test_a_request_the_runtime_never_answers_is_a_504(runtime):
    """The runtime process is stopped (SIGSTOP): the gateway answers 504 `timeout` once the
    request's timeout and the grace have passed, and serves again once the runtime resumes.
    Last in this module: a resumed runtime may count the gateway as vanished once."""
    os.kill(runtime._proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        status, error = _post(runtime, "/v1/completions", _completion())
        waited = time.monotonic() - start
    finally:
        os.kill(runtime._proc.pid, signal.SIGCONT)
    assert status == 504, error
    assert error["error"]["code"] == "timeout" and error["error"]["type"] == "timeout_error"
    assert REQUEST_TIMEOUT_S + REPLY_GRACE_S - 1 <= waited <= REQUEST_TIMEOUT_S + REPLY_GRACE_S + 5
    deadline = time.monotonic() + 30
    while (status := _post(runtime, "/v1/completions", _completion())[0]) != 200:
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert _gauges(runtime)["radixrt_http_in_flight"] == 0
