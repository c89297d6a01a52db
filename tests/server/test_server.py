"""The runtime as a real server process: concurrency, streaming, abort, bad input, lost peers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

import radixrt as rt
from radixrt.client.transport import RemoteError

from helpers import (
    assert_bad_frames_get_their_errors,
    launch_runtime,
    seeded_id_prompts,
    serve_argv,
)
from ownership import assert_no_leak, wait_idle
from timeouts import REPLY_TIMEOUT_S

LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def runtime(tiny_runtime):
    return tiny_runtime


def test_abort_waiting_and_running(tiny_model_dir):
    with launch_runtime(
        tiny_model_dir,
        max_total_tokens=1024,
        max_running_requests=1,
    ) as r:
        results = {}

        def run(name: str) -> None:
            results[name] = r.generate(
                input_ids=seeded_id_prompts(1, seed=len(name))[0],
                sampling_params=LONG,
                rid=name,
            )

        threads = [
            threading.Thread(target=run, args=(name,)) for name in ("running", "waiting-one")
        ]
        threads[0].start()
        while r.stats()["running"] == 0:
            time.sleep(0.02)
        threads[1].start()
        while r.stats()["waiting"] == 0:
            time.sleep(0.02)
        r.abort("waiting-one")
        r.abort("running")
        for t in threads:
            t.join(timeout=30)
        assert {res["meta_info"]["finish_reason"]["type"] for res in results.values()} == {"abort"}
        assert results["running"]["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
        assert_no_leak(r)


# (frame, the reply's rid, its error code): every malformed frame gets a precise answer, never internal_error
def test_bad_frames_get_errors_and_the_server_goes_on(runtime):
    assert_bad_frames_get_their_errors(runtime.url)
    out = runtime.generate(
        input_ids=seeded_id_prompts(1)[0],
        sampling_params={"max_new_tokens": 3, "temperature": 0},
    )
    assert len(out["output_ids"]) == 3
    assert_no_leak(runtime)


@pytest.mark.parametrize("stream", [True, False])
def test_killed_client_has_its_request_aborted_and_pins_released(default_runtime, stream):
    """A client killed mid-request vanishes without a word; its request, which could not finish
    for minutes (thousands of tokens on the default model), is aborted within a few seconds
    (the runtime's probe finds the connection gone, well before CLIENT_SILENCE_S), and its pin
    released. Streaming or not: a request that sends nothing is probed too."""
    script = (
        "import radixrt as rt\n"
        "e = rt.RuntimeEndpoint({url!r}, timeout=600)\n"
        "e.generate(input_ids=[5, 6, 7, 8, 9, 10], sampling_params={{'max_new_tokens': 1}})\n"
        "print('pinned', e.pin('fork-prefix', [5, 6, 7, 8, 9, 10]), flush=True)\n"
        "params = {{'max_new_tokens': 100000, 'temperature': 0, 'ignore_eos': True}}\n"
        "if {stream}:\n"
        "    for chunk in e.generate(input_ids=[5, 6, 7, 8], sampling_params=params, stream=True):\n"
        "        print('running', flush=True)\n"
        "else:\n"
        "    sub = e.client.submit(input_ids=[5, 6, 7, 8], sampling_params=params)\n"
        "    print('running', flush=True)\n"
        "    sub.finals(600)\n"
    )
    r = default_runtime
    generated = r.stats()["generated_tokens"]  # the runtime is shared: count from here
    child = subprocess.Popen(
        [sys.executable, "-c", script.format(url=r.url, stream=stream)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().startswith("pinned")
        assert child.stdout.readline().strip() == "running"
        deadline = time.monotonic() + 30
        while r.stats()["running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = r.stats()
        assert before["running"] == 1 and before["pins"] == 1
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    start = time.monotonic()
    after = wait_idle(r, timeout=15)
    assert time.monotonic() - start < 4, "noticed by silence, not by the probe"
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["generated_tokens"] - generated < r.model_info["context_length"] // 4, (
        "the request was not stopped early"
    )
    assert after["pins"] == 0
    assert_no_leak(r)


def test_api_key_is_required_when_set(tiny_model_dir):
    with launch_runtime(
        tiny_model_dir,
        max_total_tokens=512,
        api_key="s3cret",
    ) as r:
        assert r.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        with rt.RuntimeEndpoint(r.url, timeout=REPLY_TIMEOUT_S) as anonymous:
            with pytest.raises(PermissionError):
                anonymous.generate("hi", {"max_new_tokens": 2})
            with pytest.raises(PermissionError):
                anonymous.stats()
        with rt.RuntimeEndpoint(r.url, api_key="wrong", timeout=REPLY_TIMEOUT_S) as wrong:
            with pytest.raises(PermissionError):
                wrong.stats()


def test_non_loopback_bind_needs_an_api_key(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != "RADIXRT_API_KEY"}
    proc = subprocess.run(
        serve_argv(tiny_model_dir, "--host", "0.0.0.0", "--port", "1"),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0 and "api-key" in proc.stderr


def test_overloaded_queue_refuses_new_requests(tiny_model_dir):
    with launch_runtime(
        tiny_model_dir,
        max_total_tokens=1024,
        max_running_requests=1,
        max_queued_requests=1,
    ) as r:
        # long enough (over 0.2 s) that all four arrive while the first runs
        params = {**LONG, "max_new_tokens": 120}
        subs = [r.client.submit(input_ids=[5, 6, 7 + i], sampling_params=params) for i in range(4)]
        outcomes = []
        for s in subs:
            try:
                s.finals(timeout=60)
                outcomes.append("ok")
            except RemoteError as e:  # any other failure fails the test
                assert e.code == "overloaded", e
                outcomes.append(e.code)
        assert "overloaded" in outcomes and "ok" in outcomes
        assert_no_leak(r)


def test_curve_encryption(tiny_model_dir):
    public, secret = zmq.curve_keypair()
    with launch_runtime(
        tiny_model_dir,
        max_total_tokens=512,
        curve_secret_key=secret.decode(),
    ) as r:
        assert r.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        with rt.RuntimeEndpoint(
            r.url, curve_server_key=public.decode(), timeout=REPLY_TIMEOUT_S
        ) as ok:
            assert ok.health(timeout=10)
        with rt.RuntimeEndpoint(
            r.url, timeout=REPLY_TIMEOUT_S
        ) as plain:  # the handshake fails: nothing ever answers
            with pytest.raises(TimeoutError):
                plain.health(timeout=2)
