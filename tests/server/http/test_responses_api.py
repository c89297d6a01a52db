"""OpenAI's Responses API (`/v1/responses`) with the official `openai` SDK, unchanged, against one
server on the default model: a reply whole and streamed (the same text, the Responses event
types), `previous_response_id` chaining from the cache and the store (GET, DELETE, `store:
false`), a function call -> function_call_output round trip, `text.format` json_schema, and bad
input refused by name while the server serves on."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers import http_json, run_weather_agent
from timeouts import REPLY_TIMEOUT_S

GREEDY = {"model": "default", "temperature": 0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(default_runtime):
    with openai.OpenAI(
        base_url=f"{default_runtime.http_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=REPLY_TIMEOUT_S,
    ) as c:
        yield c


def test_a_streamed_response_is_the_whole_response(client):
    body = {
        **GREEDY,
        "input": "Name a river.",
        "instructions": "Be brief.",
        "max_output_tokens": 12,
    }
    whole = client.responses.create(**body)
    assert whole.output_text and whole.output[0].type == "message"
    assert whole.status in ("completed", "incomplete") and whole.id.startswith("resp_")
    with client.responses.stream(**body) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text == whole.output_text


def test_previous_response_id_chains_from_the_cache_and_the_store(client):
    first = client.responses.create(
        **GREEDY, input="Name a river.", instructions="Be brief.", max_output_tokens=8
    )
    second = client.responses.create(
        **GREEDY,
        input="Name another.",
        instructions="Be brief.",
        previous_response_id=first.id,
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**GREEDY, input="More.", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(**GREEDY, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_round_trip(client):
    ask = {**GREEDY, "input": "What is the weather in Paris?", "tools": [WEATHER]}
    first = client.responses.create(
        **ask, tool_choice="required", parallel_tool_calls=False, max_output_tokens=48
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(
        **ask, tool_choice="required", parallel_tool_calls=False, max_output_tokens=48
    ) as stream:
        streamed = stream.get_final_response()
    assert [(o.name, o.arguments) for o in streamed.output] == [(call.name, call.arguments)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    answer = client.responses.create(
        **GREEDY,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        previous_response_id=first.id,
        max_output_tokens=12,
    )
    assert answer.output_text and [o.type for o in answer.output] == ["message"]
    assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string", "maxLength": 12}},
        "required": ["river"],
    }
    out = client.responses.create(
        **GREEDY,
        input="Name a river as JSON.",
        text={"format": {"type": "json_schema", "name": "river", "schema": schema}},
        max_output_tokens=24,
    )
    jsonschema.validate(json.loads(out.output_text), schema)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image content is not supported",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
            "no function_call before it",
        ),
        ({"input": "Hi", "extra_body": {"frequency": 1}}, "unknown field 'frequency'"),
    ],
)
def test_bad_input_is_refused_by_name(client, kwargs, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", max_output_tokens=2, **kwargs)
    assert named in e.value.message and e.value.code == "invalid_request"
    ok = client.responses.create(**GREEDY, input="Hi", max_output_tokens=2)
    assert ok.usage.output_tokens == 2  # the server serves on


def _stored(rid: str, text: str = "", parent=None):
    from radixrt.server.http.openai_responses import ResponsesRequest, Stored

    return Stored.of({"id": rid}, ResponsesRequest(input=text).input, parent)


def test_a_conversation_is_bounded_by_what_it_holds_not_by_its_prompt(default_runtime):
    """Reasoning items' encrypted content is stored but never reaches the prompt: a chain of
    them (the issue's 120-byte continuations of a 56 MB chain, each re-parsed on the event
    loop) is refused past --max-prompt-bytes (4 MiB here) by what it holds; the server serves on."""
    url = f"{default_runtime.http_url}/v1/responses"
    secret = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "encrypted_content": "x" * (3 << 20),
    }
    ask = {"model": "default", "temperature": 0, "max_output_tokens": 2}
    status, first = http_json(url, {**ask, "input": [secret, {"role": "user", "content": "Hi"}]})
    assert status == 200, first
    status, body = http_json(url, {**ask, "input": "Hi again", "previous_response_id": first["id"]})
    assert status == 200, body  # 3 MiB held, within the bound
    heavy = {**secret, "encrypted_content": "y" * (2 << 20)}
    chained = {**ask, "input": [heavy, {"role": "user", "content": "More"}]}
    status, body = http_json(url, {**chained, "previous_response_id": body["id"]})
    assert status == 400 and body["error"]["param"] == "previous_response_id"
    assert "--max-prompt-bytes" in body["error"]["message"]
    assert http_json(url, {**ask, "input": "Hello"})[0] == 200


def test_the_store_is_bounded_per_tenant():
    """Model-free: the oldest responses go past the count or the bytes, per tenant."""
    from radixrt.server.http.errors import APIError
    from radixrt.server.http.openai_responses import ResponseStore

    store = ResponseStore(per_tenant=3, bytes_per_tenant=3000)
    for k in range(5):
        store.put("a", _stored(f"r{k}"))
    store.put("b", _stored("big", "x" * 1500))
    store.put("b", _stored("bigger", "x" * 1500))
    assert list(store.tenants["a"].index) == ["r2", "r3", "r4"]
    assert list(store.tenants["b"].index) == ["bigger"]
    with pytest.raises(APIError):
        store.get("b", "r4")  # another tenant's
    store.delete("a", "r3")
    assert list(store.tenants["a"].index) == ["r2", "r4"]
    assert store.held == sum(s.size for t in store.tenants.values() for s in t.index.values())


def test_a_chain_counts_against_its_tenant_until_nothing_continues_it():
    """Model-free: a response continued by a held one stays counted after it leaves the index
    (its items are part of the later conversation), and is freed with the last one holding it;
    a conversation that alone would pass the tenant's bound is refused before it runs; past
    the total bound, the tenant holding the most loses its oldest."""
    from radixrt.server.http.errors import APIError
    from radixrt.server.http.openai_responses import ResponseStore

    store = ResponseStore(bytes_per_tenant=6000, total_bytes=7000)
    first = _stored("t1", "x" * 1500)
    store.put("a", first)
    second = _stored("t2", "y" * 1500, parent=first)
    store.put("a", second)
    store.delete("a", "t1")
    assert store.tenants["a"].bytes == first.size + second.size  # t2 continues t1
    assert [i.content[0].text[0] for i in second.conversation()] == ["x", "y"]
    with pytest.raises(APIError) as refused:
        store.check_room(second, _stored("t3", "z" * 3000).conversation())
    assert "--max-stored-response-bytes-per-tenant" in str(refused.value)
    store.put("b", _stored("b1", "w" * 3000))
    assert "a" not in store.tenants and list(store.tenants["b"].index) == ["b1"]
    assert store.held == store.tenants["b"].bytes


def test_an_openai_agents_agent_runs_on_the_responses_model(default_runtime):
    """openai-agents, unchanged, with its Responses model class: the model must call the tool
    on the first turn (tool_choice required, reset after the call), then answers. The limit is
    generous: the SDK treats a reply cut by max_output_tokens (`incomplete`) as a failure."""
    run_weather_agent("OpenAIResponsesModel", default_runtime.http_url, max_tokens=400)
