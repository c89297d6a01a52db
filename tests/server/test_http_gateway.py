"""The OpenAI-compatible HTTP gateway, through the official `openai` client, against real servers."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import radixrt as rt
from radixrt.http_bench import HttpBenchConfig, run_http_bench
from radixrt.runtime import free_port

GREEDY = {"temperature": 0, "max_tokens": 8}
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
KEY = "sesame"


@pytest.fixture(scope="module")
def runtime(tiny_model_dir):
    with rt.Runtime(model=str(tiny_model_dir), http_port=free_port(), api_key=KEY, max_total_tokens=4096,
                    log_level="warning") as r:
        yield r


@pytest.fixture(scope="module")
def client(runtime):
    with openai.OpenAI(base_url=f"{runtime.http_url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _metrics(runtime) -> dict[str, float]:
    """Every sample of /metrics, which must parse as Prometheus text."""
    with urllib.request.urlopen(f"{runtime.http_url}/metrics") as reply:
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
    out = client.completions.create(model="default", prompt="The capital of France is", logprobs=2, **GREEDY)
    expected = runtime.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    choice = out.choices[0]
    assert choice.text == expected["text"] and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_chat_stream_joins_to_the_greedy_answer(client):
    whole = client.chat.completions.create(model="default", messages=QUESTION, **GREEDY)
    answer = whole.choices[0].message
    assert answer.role == "assistant" and answer.content
    chunks = list(client.chat.completions.create(model="default", messages=QUESTION, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_samples_and_logprobs(client):
    out = client.chat.completions.create(model="default", messages=QUESTION, n=2, temperature=0.8, seed=1,
                                         max_tokens=4, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)


def test_json_response_formats(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    out = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(out.choices[0].message.content)) == {"city"}
    out = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=12,
                                         response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_second_turn_reuses_the_cached_history(client):
    messages = [{"role": "system", "content": "You answer in French. " * 8},
                {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="default", messages=messages, **GREEDY)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.create(model="default", messages=messages, **GREEDY)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_metrics_parse_and_move(runtime, client):
    before = _metrics(runtime)
    client.completions.create(model="default", prompt="One, two, three,", **GREEDY)
    after = _metrics(runtime)
    key = 'radixrt_http_requests_total{"code": "200", "endpoint": "/v1/completions"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["radixrt_generation_tokens_total{}"] > before["radixrt_generation_tokens_total{}"]
    assert after["radixrt_time_to_first_token_seconds_count{}"] > before["radixrt_time_to_first_token_seconds_count{}"]
    for name in ("radixrt_inter_token_latency_seconds_count", "radixrt_cache_hit_rate", "radixrt_num_requests_waiting",
                 "radixrt_num_requests_running", "radixrt_preemptions_total", "radixrt_evicted_tokens_total",
                 "radixrt_kv_free_tokens", "radixrt_cached_prompt_tokens_total"):
        assert name + "{}" in after, name


def test_models(runtime, client):
    assert [m.id for m in client.models.list()] == [runtime.model_info["model"]]


@pytest.mark.parametrize("call, status, words", [
    (lambda c: c.chat.completions.create(model="default", messages=[]), 400, "messages"),
    (lambda c: c.chat.completions.create(model="default", messages=QUESTION, temperature=-1), 400, "temperature"),
    (lambda c: c.completions.create(model="default", prompt="hello " * 9000), 400, "prompt has"),
    (lambda c: c.chat.completions.create(model="default", messages=QUESTION,
                                         response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "schema"),
    (lambda c: c.chat.completions.create(model="default", messages=QUESTION, top_logprobs=2), 400, "logprobs"),
])
def test_bad_requests_get_4xx_in_openai_shape(client, call, status, words):
    with pytest.raises(openai.APIStatusError) as info:
        call(client)
    error = info.value.response.json()["error"]
    assert info.value.status_code == status and words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def _post(runtime, path: str, body: bytes, timeout: float | None = None):
    request = urllib.request.Request(f"{runtime.http_url}{path}", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    return urllib.request.urlopen(request, timeout=timeout)


def test_malformed_json_body(runtime):
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(runtime, "/v1/chat/completions", b"{not json")
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["message"]


def test_client_disconnect_aborts(runtime):
    """A client that hangs up (streaming, or not) stops its request long before its 1000 tokens."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}
    generated = runtime.stats()["generated_tokens"]
    conn = http.client.HTTPConnection(runtime.args.http_host, runtime.args.http_port)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: ")  # the first token came; hang up
    conn.close()
    _wait_idle(runtime)
    with pytest.raises(TimeoutError):
        _post(runtime, "/v1/completions", json.dumps(body).encode(), timeout=0.2)
    _wait_idle(runtime)
    assert runtime.stats()["generated_tokens"] - generated < 1000


def test_api_key_is_enforced(runtime):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{runtime.http_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.response.json()["error"]["type"] == "authentication_error"
    with urllib.request.urlopen(f"{runtime.http_url}/health") as reply:  # probes need no key
        assert reply.status == 200


def test_http_bench_smoke(tiny_model_dir):
    result = run_http_bench(HttpBenchConfig(model=str(tiny_model_dir), num_conversations=2, num_turns=2,
                                            max_new_tokens=4, max_total_tokens=4096))
    for path in ("zmq", "http"):
        assert result[path]["output_tokens"] > 0 and 0 < result[path]["cache_hit_rate"] < 1
    assert result["zmq"]["output_tokens"] == result["http"]["output_tokens"]
