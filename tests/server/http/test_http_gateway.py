"""The OpenAI-compatible HTTP gateway, through the official `openai` client and plain HTTP,
against real servers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixrt.bench.http_bench import HttpBenchConfig, run_http_bench
from radixrt.config import GatewaySettings
from radixrt.server.http.gateway import MAX_FANOUT

from helpers import gateway_pid, launch_runtime

GREEDY = {"temperature": 0, "max_tokens": 8}
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
KEY = "sesame"
HTTP_TIMEOUT_S = 60.0  # one reply from the gateway on a loaded 2-core machine, with room to spare
MAX_BODY_BYTES = GatewaySettings().max_frame_bytes  # the gateway's body cap


@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir):
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        api_key=KEY,
        max_total_tokens=4096,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def client(runtime):
    with openai.OpenAI(
        base_url=f"{runtime.http_url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S
    ) as c:
        yield c


def _metrics(runtime) -> dict[str, float]:
    """Every sample of /metrics, which must parse as Prometheus text."""
    admin = urllib.request.Request(  # the lone --api-key is the admin's: /metrics needs it
        f"{runtime.http_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(admin, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return samples


def _wait_idle(runtime, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = runtime.stats()
        if stats["running"] == stats["waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"requests still running after {timeout}s")


def test_completion_matches_the_zmq_path(runtime, client):
    prompt = "The capital of France is"
    out = client.completions.create(model="default", prompt=prompt, logprobs=2, **GREEDY)
    expected = runtime.generate(prompt, {"temperature": 0, "max_new_tokens": 8})
    choice = out.choices[0]
    assert choice.text == expected["text"] and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    logprobs = choice.logprobs
    assert out.usage.completion_tokens == len(logprobs.tokens) == len(logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_chat_stream_joins_to_the_greedy_answer(client):
    whole = client.chat.completions.create(model="default", messages=QUESTION, **GREEDY)
    answer = whole.choices[0].message
    assert answer.role == "assistant" and answer.content
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.content
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish_reasons[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_samples_and_logprobs(client):
    out = client.chat.completions.create(
        model="default",
        messages=QUESTION,
        n=2,
        temperature=0.8,
        seed=1,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)


def test_json_response_formats(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    out = client.chat.completions.create(
        model="default",
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    assert set(json.loads(out.choices[0].message.content)) == {"city"}
    out = client.chat.completions.create(
        model="default",
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        response_format={"type": "json_object"},
    )
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_second_turn_reuses_the_cached_history(client):
    messages = [
        {"role": "system", "content": "You answer in French. " * 8},
        {"role": "user", "content": "Name a colour."},
    ]
    first = client.chat.completions.create(model="default", messages=messages, **GREEDY)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    second = client.chat.completions.create(model="default", messages=messages, **GREEDY)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_metrics_parse_and_move(runtime, client):
    before = _metrics(runtime)
    client.completions.create(model="default", prompt="One, two, three,", **GREEDY)
    after = _metrics(runtime)
    model = json.dumps(runtime.model_info["model"])
    key = f'radixrt_http_requests_total{{"code": "200", "endpoint": "/v1/completions", "model_name": {model}}}'
    assert after[key] == before.get(key, 0) + 1
    label = f'{{"model_name": {model}}}'
    for moved in (
        "radixrt_generation_tokens_total",
        "radixrt_time_to_first_token_seconds_count",
    ):
        assert after[moved + label] > before[moved + label], moved
    for name in (
        "radixrt_inter_token_latency_seconds_count",
        "radixrt_queue_time_seconds_count",
        "radixrt_kv_usage_ratio",
        "radixrt_cache_hit_rate",
        "radixrt_num_requests_waiting",
        "radixrt_num_requests_running",
        "radixrt_preemptions_total",
        "radixrt_evicted_tokens_total",
        "radixrt_kv_free_tokens",
        "radixrt_cached_prompt_tokens_total",
        "radixrt_spec_accepted_tokens_total",
        "radixrt_spec_accept_length",
        "radixrt_host_kv_tokens",
        "radixrt_host_hit_tokens_total",
        "radixrt_swapped_in_tokens_total",
    ):
        assert name + label in after, name


def test_models(runtime, client):
    assert [m.id for m in client.models.list()] == [runtime.model_info["model"]]


def _chat(c, **kwargs):
    return c.chat.completions.create(model="default", **{"messages": QUESTION, **kwargs})


@pytest.mark.parametrize(
    "call, status, words",
    [
        (lambda c: _chat(c, messages=[]), 400, "messages"),
        (lambda c: _chat(c, temperature=-1), 400, "temperature"),
        (
            lambda c: c.completions.create(model="default", prompt="hello " * 9000),
            400,
            "prompt has",
        ),
        (
            lambda c: _chat(
                c, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
            ),
            400,
            "schema",
        ),
        (lambda c: _chat(c, top_logprobs=2), 400, "logprobs"),
    ],
)
def test_bad_requests_get_4xx_in_openai_shape(client, call, status, words):
    with pytest.raises(openai.APIStatusError) as info:
        call(client)
    error = info.value.response.json()["error"]
    assert info.value.status_code == status and words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def _post(runtime, path: str, body: bytes, timeout: float = HTTP_TIMEOUT_S):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    request = urllib.request.Request(f"{runtime.http_url}{path}", data=body, headers=headers)
    return urllib.request.urlopen(request, timeout=timeout)


def test_malformed_json_body(runtime):
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(runtime, "/v1/chat/completions", b"{not json")
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["message"]


def test_client_disconnect_aborts(runtime):
    """A client that hangs up (streaming, or not) stops its request long before its 1000 tokens."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}
    generated = runtime.stats()["generated_tokens"]
    conn = http.client.HTTPConnection(
        runtime.args.http_host, runtime.args.port, timeout=HTTP_TIMEOUT_S
    )
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({**body, "stream": True}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    reply = conn.getresponse()
    # the first token came; hang up
    assert reply.status == 200 and reply.readline().startswith(b"data: ")
    conn.close()
    _wait_idle(runtime)
    with pytest.raises(TimeoutError):
        _post(runtime, "/v1/completions", json.dumps(body).encode(), timeout=0.2)
    _wait_idle(runtime)
    assert runtime.stats()["generated_tokens"] - generated < 1000


def test_api_key_is_enforced(runtime):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(
            base_url=f"{runtime.http_url}/v1",
            api_key="wrong",
            max_retries=0,
            timeout=HTTP_TIMEOUT_S,
        ).models.list()
    assert info.value.response.json()["error"]["type"] == "authentication_error"
    # probes need no key
    with urllib.request.urlopen(f"{runtime.http_url}/health", timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status == 200


def test_http_bench_smoke(tiny_model_dir):
    result = run_http_bench(
        HttpBenchConfig(
            model=str(tiny_model_dir),
            num_conversations=2,
            num_turns=2,
            max_new_tokens=4,
            max_total_tokens=4096,
        )
    )
    for path in ("zmq", "http"):
        assert result[path]["output_tokens"] > 0 and 0 < result[path]["cache_hit_rate"] < 1
    assert result["zmq"]["output_tokens"] == result["http"]["output_tokens"]


# ---- errors in OpenAI's shape, end to end --------------------------------------------------------


def _request(url: str, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    """POST `body` as JSON with exactly `headers`; the status and the parsed reply."""
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _authorized(url: str, path: str, body: dict) -> tuple[int, dict]:
    return _request(url, path, body, {"Authorization": f"Bearer {KEY}"})


def test_bodies_and_fan_outs_are_bounded(runtime):
    """A body past the cap is 413 whether it declares its length or streams in chunks, and a
    prompt list that would fan out to more requests than one call may make is 400; nothing of
    either reaches the runtime, which serves on."""
    generated = runtime.stats()["generated_tokens"]
    host, port = runtime.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HTTP_TIMEOUT_S)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()  # refused by its declared length, before any of it is sent
    reply = conn.getresponse()
    assert reply.status == 413 and "body" in json.loads(reply.read())["error"]["message"]
    conn.close()

    conn = http.client.HTTPConnection(host, int(port), timeout=HTTP_TIMEOUT_S)
    chunks = (b"x" * (1 << 20) for _ in range(MAX_BODY_BYTES // (1 << 20) + 2))
    conn.request(
        "POST",
        "/v1/completions",
        body=chunks,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        encode_chunked=True,
    )
    assert conn.getresponse().status == 413
    conn.close()

    wide = {"model": "tiny", "prompt": ["hi"] * (MAX_FANOUT // 2 + 1), "n": 2, "max_tokens": 1}
    status, body = _authorized(runtime.http_url, "/v1/completions", wide)
    assert status == 400 and body["error"]["param"] == "prompt"
    assert runtime.stats()["generated_tokens"] == generated
    status, _ = _authorized(
        runtime.http_url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    )
    assert status == 200


def test_no_authorization_header_is_401(runtime):
    """A chat completion without any Authorization header is refused with 401 and OpenAI's error
    body: type authentication_error, code invalid_api_key; no request reaches the runtime."""
    generated = runtime.stats()["generated_tokens"]
    status, body = _request(
        runtime.http_url,
        "/v1/chat/completions",
        {"model": "tiny", "messages": QUESTION, "max_tokens": 2},
        {},
    )
    assert status == 401
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert runtime.stats()["generated_tokens"] == generated


def test_anthropics_x_api_key_is_checked_like_a_bearer_key(runtime):
    """The `anthropic` SDK sends its key as `x-api-key`: the server's key is served, a wrong one
    is a 401 in Anthropic's shape on /v1/messages."""
    import anthropic

    def client(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=runtime.http_url, api_key=key, max_retries=0, timeout=HTTP_TIMEOUT_S
        )

    messages = [{"role": "user", "content": "Hi"}]
    with client(KEY) as good:
        reply = good.messages.create(model="tiny", max_tokens=2, messages=messages)
    assert reply.usage.output_tokens == 2
    with client("wrong") as bad, pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="tiny", max_tokens=2, messages=messages)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"


LONG_CHAT = [{"role": "user", "content": "hello " * 1100}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": [5] * 1100}),
        ("/v1/chat/completions", {"messages": LONG_CHAT}),
    ],
)
def test_prompt_beyond_the_context_is_context_length_exceeded(runtime, path, body, stream):
    """A prompt longer than the tiny model's 1024-token context (token ids, or chat text), streamed
    or not, gets 400 before any stream starts, with code context_length_exceeded."""
    request = {"model": "tiny", "max_tokens": 2, "stream": stream, **body}
    status, reply = _authorized(runtime.http_url, path, request)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["code"] == "context_length_exceeded"


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout}s")
        time.sleep(0.05)


def test_overloaded_runtime_answers_503(tiny_model_dir):
    """With one request running and one queued (max_running_requests=1, max_queued_requests=1), a
    completion gets 503 with type overloaded_error instead of waiting."""
    long = {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}
    with launch_runtime(
        tiny_model_dir,
        http=True,
        max_running_requests=1,
        max_queued_requests=1,
    ) as r:
        running = r.client.submit(input_ids=[5, 6, 7], sampling_params=long)
        _wait_for(lambda: r.stats()["running"] == 1, 30, "running")
        queued = r.client.submit(input_ids=[5, 6, 8], sampling_params=long)
        _wait_for(lambda: r.stats()["waiting"] == 1, 30, "queued")
        status, reply = _request(
            r.http_url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}, {}
        )
        assert r.stats()["running"] == 1  # still full when the refusal came
        for sub in (running, queued):
            r.client.abort(sub.rid)
        _wait_for(lambda: r.stats()["running"] == r.stats()["waiting"] == 0, 30, "idle")
    assert status == 503, reply
    assert reply["error"]["type"] == "overloaded_error"


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_to_the_end(reply) -> list[str]:
    """The complete lines left in a streamed reply, up to its end or to where the connection was
    cut (mid-chunk); the connection's socket timeout bounds each wait."""
    lines = []
    try:
        while line := reply.readline():
            lines.append(line.decode())
    except (http.client.IncompleteRead, ConnectionError):
        pass
    return [line for line in lines if line.endswith("\n")]


def test_runtime_death_mid_stream_ends_the_stream_and_the_gateway(tiny_model_dir):
    """Killing the runtime while a stream is in flight: the stream ends within 15 s, without
    `data: [DONE]` (the answer is incomplete), the gateway process exits by itself within 15 s,
    and the stream's last event is an OpenAI error with code connection_lost."""
    r = launch_runtime(
        tiny_model_dir,
        http=True,
    )
    gateway = gateway_pid(r._proc.pid)
    conn = http.client.HTTPConnection(r.args.http_host, r.args.port, timeout=HTTP_TIMEOUT_S)
    try:
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 1000,
            "temperature": 0,
            "stream": True,
        }
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = conn.getresponse()
        assert reply.status == 200 and reply.readline().startswith(b"data: {")
        r._proc.kill()
        r._proc.wait(timeout=10)
        start = time.monotonic()
        conn.sock.settimeout(20)
        lines = _read_to_the_end(reply)
        ended_after = time.monotonic() - start
        _wait_for(lambda: not _alive(gateway), 15, "the gateway gone")
    finally:
        conn.close()
        r._finalizer()  # the runtime is gone: skip the polite shutdown call
        if _alive(gateway):
            os.kill(gateway, signal.SIGKILL)
    events = [line.removeprefix("data: ").strip() for line in lines if line.startswith("data: ")]
    assert ended_after < 15 and "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "connection_lost"
