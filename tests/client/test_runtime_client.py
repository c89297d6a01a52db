"""A client of the runtime process: many threads and asyncio tasks on one endpoint, streams
(sync and async), and an endpoint that outlives a server restart."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import pytest

import radixrt as rt
from radixrt.client.launcher import free_port

from helpers import seeded_id_prompts, serve_argv
from ownership import assert_no_leak


@pytest.fixture(scope="module")
def runtime(tiny_runtime):
    return tiny_runtime


def test_concurrent_threads_and_asyncio_get_their_own_replies(runtime):
    prompts = seeded_id_prompts(64)
    params = [
        {"max_new_tokens": 4 + i % 5, "temperature": 0, "ignore_eos": True} for i in range(64)
    ]
    expected = [
        runtime.generate(input_ids=p, sampling_params=sp)["output_ids"]
        for p, sp in zip(prompts, params)
    ]
    got: dict[int, list[int]] = {}

    def worker(indices: list[int]) -> None:
        for i in indices:
            got[i] = runtime.generate(input_ids=prompts[i], sampling_params=params[i])["output_ids"]

    async def async_client(indices: list[int]) -> None:
        outs = await asyncio.gather(
            *(
                runtime.async_generate(input_ids=prompts[i], sampling_params=params[i])
                for i in indices
            )
        )
        got.update({i: o["output_ids"] for i, o in zip(indices, outs)})

    threads = [threading.Thread(target=worker, args=(list(range(t, 48, 8)),)) for t in range(8)]
    threads.append(threading.Thread(target=lambda: asyncio.run(async_client(list(range(48, 64))))))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(64)] == expected
    assert_no_leak(runtime)


def test_streaming_deltas_join_to_the_final_text(default_runtime):
    engine = default_runtime
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write 'café, 世界, 🎉' three times."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    chunks = list(engine.generate(prompt, {"max_new_tokens": 48, "temperature": 0}, stream=True))
    final = chunks[-1]
    deltas = [c["delta"] for c in chunks[:-1]]
    assert final["finished"] and "".join(deltas) == final["text"]
    assert all("\ufffd" not in d for d in deltas)
    assert [t for c in chunks[:-1] for t in c["token_ids"]] == final["output_ids"]
    assert (
        final["text"] == engine.generate(prompt, {"max_new_tokens": 48, "temperature": 0})["text"]
    )
    # text that may begin a stop string is held back, so the stop never leaks into a delta
    stop = final["text"][5:9]
    chunks = list(
        engine.generate(prompt, {"max_new_tokens": 48, "temperature": 0, "stop": stop}, stream=True)
    )
    assert "".join(c["delta"] for c in chunks[:-1]) == chunks[-1]["text"] == final["text"][:5]


def test_async_stream(runtime):
    async def main() -> list[dict]:
        return [
            c
            async for c in runtime.async_stream(
                input_ids=seeded_id_prompts(1)[0],
                sampling_params={"max_new_tokens": 6, "temperature": 0},
            )
        ]

    chunks = asyncio.run(main())
    assert chunks[-1]["finished"] and len(chunks[-1]["output_ids"]) == 6


def test_server_restart_fails_in_flight_requests_then_recovers(tiny_model_dir):
    port = free_port()
    cmd = serve_argv(
        tiny_model_dir,
        "--zmq-port",
        str(port),
        "--disable-http",  # restarted on the same ZeroMQ port; HTTP is not the point
        "--max-total-tokens",
        "1024",
        "--log-level",
        "warning",
    )
    server = subprocess.Popen(cmd)
    endpoint = rt.RuntimeEndpoint(f"tcp://127.0.0.1:{port}", timeout=120)
    try:
        _wait_healthy(endpoint)
        errors = []

        def long_request() -> None:
            try:
                endpoint.generate(
                    input_ids=[5, 6, 7],
                    sampling_params={"max_new_tokens": 100000, "ignore_eos": True},
                )
            except Exception as e:  # what the user sees
                errors.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        while endpoint.stats()["running"] == 0:
            time.sleep(0.05)
        server.kill()
        server.wait()
        server = subprocess.Popen(cmd)
        t.join(timeout=120)
        assert (
            len(errors) == 1
            and isinstance(errors[0], ConnectionError)
            and "restarted" in str(errors[0])
        )
        _wait_healthy(endpoint)
        assert len(endpoint.generate("hello", {"max_new_tokens": 2})["output_ids"]) == 2
    finally:
        endpoint.close()
        server.terminate()
        server.wait()


def _wait_healthy(endpoint, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            endpoint.health(timeout=1)
            return
        except TimeoutError:
            pass
    raise AssertionError("server did not come up")
