"""Chat templates cannot disable the chat routes (issue 60, item 3): a template that loops when a
message holds a trigger word is stopped at `--chat-template-timeout` in its render process
(killed and replaced) and the request gets 400 `invalid_request` naming the limit, while the
next chat is served; a repetition bomb is refused at once; a tenant's renders take at most half
the render processes; ordinary chats render as before. The pool alone (no model), then a real
gateway and runtime (the tiny random model) over HTTP."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import pytest

from radixrt.client.chat_render import RenderJob
from radixrt.server.http.cpu_pool import CALLER, Caller
from radixrt.server.http.errors import APIError
from radixrt.server.http.template_pool import TemplatePool

from helpers import http_json

TIMEOUT_S = 1.5  # --chat-template-timeout here
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ~10^10 iterations when a message holds the trigger word (no `range`: its budget would stop it)
TRIGGERED = (
    "{% for m in messages %}{% if 'xyzzy' in m.content %}"
    "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}"
    "{% endif %}{% if 'boom' in m.content %}{{ 'a' * 1500000000 }}{% endif %}"
    "{% if 'double' in m.content %}{% set ns = namespace(s=m.content) %}"
    "{% for i in range(64) %}{% set ns.s = twice(ns.s) %}{% endfor %}{% endif %}{% endfor %}"
)
TEMPLATE = "{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}" + TRIGGERED + CHATML


def _job(content: str, template: str = TEMPLATE) -> bytes:
    return RenderJob(template, [{"role": "user", "content": content}], max_bytes=1 << 20).to_json()


async def _render(pool: TemplatePool, content: str, tenant: str = "") -> tuple[str, float]:
    """(the prompt or the error's message, seconds) of one render as `tenant`."""
    CALLER.set(Caller(tenant))
    start = time.perf_counter()
    try:
        result = await pool.render(_job(content))
    except APIError as e:
        assert e.status == 400 and e.code == "invalid_request", (e.status, e.code, str(e))
        result = str(e)
    return result, time.perf_counter() - start


@pytest.fixture
def pool():
    pool = TemplatePool(4, TIMEOUT_S, 1 << 30)
    yield pool
    pool.close()


def test_a_looping_render_is_stopped_and_its_worker_replaced(pool):
    async def run() -> None:
        message, took = await _render(pool, "say xyzzy")
        assert "--chat-template-timeout" in message and TIMEOUT_S <= took < TIMEOUT_S + 2
        prompt, took = await _render(pool, "hello")
        assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        message, took = await _render(pool, "boom")
        assert "at most" in message and took < 1.0
        # past the sandbox's checks (a macro doubling its text): the worker's memory limit, or
        # its time limit when the copies take longer
        message, took = await _render(pool, "double")
        assert "memory" in message or "--chat-template-timeout" in message, message
        assert took < TIMEOUT_S + 1
        assert (await _render(pool, "hello"))[0].endswith("assistant\n")

    asyncio.run(run())
    assert pool.killed >= 1


def test_a_tenant_takes_at_most_half_the_render_workers(pool):
    """Four looping renders of one tenant run two at a time; another tenant's ordinary renders
    are answered meanwhile, at once."""

    async def run() -> None:
        await _render(pool, "warm")  # the workers are started
        loops = [asyncio.ensure_future(_render(pool, "xyzzy", "mallory")) for _ in range(4)]
        await asyncio.sleep(0.2)
        others = [await _render(pool, f"hi {i}", "alice") for i in range(10)]
        assert all(p.endswith("assistant\n") for p, _ in others)
        assert max(t for _, t in others) < 0.8 * TIMEOUT_S, others
        done = await asyncio.gather(*loops)
        assert all("--chat-template-timeout" in m for m, _ in done)
        # two at a time: the last two waited for the first two
        assert max(t for _, t in done) >= 2 * TIMEOUT_S - 0.1, done

    asyncio.run(run())


def test_warm_render_latency(pool):
    """What a render through a warm process adds to the same render in this process (printed;
    `pytest -s` shows it): a round trip of the job and the prompt, about a millisecond."""
    from radixrt.client.chat_render import Renderer

    messages = [
        {"role": "user" if i % 2 else "assistant", "content": "word " * 40} for i in range(8)
    ]
    job = RenderJob(CHATML, messages)

    async def run() -> list[float]:
        await pool.render(job.to_json())
        times = []
        for _ in range(50):
            start = time.perf_counter()
            await pool.render(job.to_json())
            times.append(time.perf_counter() - start)
        return times

    pooled = asyncio.run(run())
    renderer = Renderer()
    renderer.render(job)
    local = []
    for _ in range(50):
        start = time.perf_counter()
        renderer.render(job)
        local.append(time.perf_counter() - start)
    added_ms = 1000 * (statistics.median(pooled) - statistics.median(local))
    print(
        f"render in process {1000 * statistics.median(local):.2f} ms, through a worker "
        f"{1000 * statistics.median(pooled):.2f} ms (median of 50): +{added_ms:.2f} ms"
    )
    assert added_ms < 50


# ---- a real gateway --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir):
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        max_total_tokens=4096,
        chat_template=TEMPLATE,
        chat_template_timeout=TIMEOUT_S,
    ) as r:
        yield r


def _chat(runtime, content: str, path: str = "/v1/chat/completions") -> tuple[int, dict, float]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }
    start = time.perf_counter()
    status, reply = http_json(f"{runtime.http_url}{path}", body, timeout=60)
    return status, reply, time.perf_counter() - start


def test_a_trigger_word_gets_400_and_the_routes_keep_serving(runtime):
    """Several looping requests (more than the render processes) on both chat routes: each is a
    400 naming the limit within it (and a worker's wait), and an ordinary chat right after is
    served."""
    for path in ("/v1/chat/completions", "/v1/messages"):
        status, reply, took = _chat(runtime, "please xyzzy", path)
        assert status == 400, reply
        assert "--chat-template-timeout" in json.dumps(reply)
        assert took < TIMEOUT_S + 5
        status, reply, took = _chat(runtime, "hello", path)
        assert status == 200, reply


def test_looping_requests_at_once_leave_the_route_serving(runtime):
    """The issue's probe: five looping requests at once (one tenant: the server has no keys),
    then an ordinary chat while they run. Each looping one is a 400 once its turn came and its
    render was stopped (five renders, two at a time); the ordinary one is served after them
    (it queues behind its tenant's turns), and one after them at once."""
    results: list[tuple[int, dict, float]] = []
    threads = [
        threading.Thread(target=lambda: results.append(_chat(runtime, "xyzzy!"))) for _ in range(5)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    status, reply, took = _chat(runtime, "hello")
    for t in threads:
        t.join()
    assert status == 200, reply
    assert took < 3 * TIMEOUT_S + 5
    assert [s for s, _, _ in results] == [400] * 5
    assert max(t for _, _, t in results) < 3 * TIMEOUT_S + 5
    status, reply, took = _chat(runtime, "hello")
    assert status == 200 and took < TIMEOUT_S, (status, took)


def test_a_repetition_bomb_is_refused_at_once(runtime):
    status, reply, took = _chat(runtime, "boom")
    assert status == 400 and reply["error"]["code"] == "invalid_request", reply
    assert "--max-prompt-bytes" in reply["error"]["message"] and took < TIMEOUT_S
    assert _chat(runtime, "hello")[0] == 200


def test_ordinary_chat_is_the_templates_prompt(runtime):
    """The chat's greedy reply is the completion of the prompt the template renders."""
    status, chat, _ = _chat(runtime, "What is the capital of France?")
    assert status == 200
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, text = http_json(f"{runtime.http_url}/v1/completions", body, timeout=60)
    assert status == 200
    assert chat["choices"][0]["message"]["content"] == text["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == text["usage"]["prompt_tokens"]
