"""Tool calling on /v1/chat/completions with the official `openai` client and a real agent
framework (openai-agents), against one server on the default model: calls under `required` and a
named function always parse and validate, streamed deltas join into the same calls, a call ->
result -> answer loop reuses the cached first turn, parallel calls, `none`, malformed tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers import run_weather_agent
from timeouts import REPLY_TIMEOUT_S

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
VOLUME = {
    "type": "function",
    "function": {
        "name": "set_volume",
        "description": "Set the speaker volume",
        "parameters": {
            "type": "object",
            "properties": {
                "level": {"type": "integer", "minimum": 1, "maximum": 10},
                "fade_s": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 30},
            },
            "required": ["level"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, VOLUME]}
QUESTION = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
GREEDY = {"temperature": 0, "max_tokens": 96}

pytestmark = pytest.mark.model  # the default model, behind every test here


@pytest.fixture(scope="module")
def runtime(default_runtime):
    return default_runtime


@pytest.fixture(scope="module")
def client(runtime):
    with openai.OpenAI(
        base_url=f"{runtime.http_url}/v1", api_key="unused", max_retries=0, timeout=REPLY_TIMEOUT_S
    ) as c:
        yield c


def _chat(client, **kwargs):
    return client.chat.completions.create(model="default", tools=TOOLS, **kwargs)


def _valid(call, names=tuple(SCHEMAS)) -> dict:
    """The call's arguments, once they parse and validate against its tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}]
)
def test_sampled_calls_always_parse_and_validate(client, tool_choice):
    """10 sampled calls each way (20 in all), one call each (parallel_tool_calls=false)."""
    out = _chat(
        client,
        messages=QUESTION,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        n=10,
        temperature=1.0,
        seed=7,
        max_tokens=128,
    )
    names = ("add",) if isinstance(tool_choice, dict) else tuple(SCHEMAS)
    assert len(out.choices) == 10
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        _valid(call, names)


def test_bounded_arguments_stay_in_range(client):
    """A tool whose schema has numeric bounds (a pydantic `Field(ge=..., le=...)`) decodes under
    llguidance: 10 sampled calls, each in range."""
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Turn the music up loud, fading in slowly."}],
        tools=[VOLUME, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        n=10,
        temperature=1.0,
        seed=11,
        max_tokens=64,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _valid(call, ("set_volume", "add"))


def test_streamed_deltas_join_into_the_same_calls(client):
    whole = _chat(client, messages=QUESTION, tool_choice="required", **GREEDY).choices[0]
    joined: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, messages=QUESTION, tool_choice="required", stream=True, **GREEDY):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            if piece.index not in joined:  # the first delta: index, id, type and name
                assert piece.id.startswith("call_") and piece.type == "function"
                assert piece.function.name and piece.function.arguments == ""
                joined[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
                joined[piece.index]["arguments"] += piece.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    assert [joined[i] for i in sorted(joined)] == expected


def test_parallel_calls_and_one_call(client):
    many = _chat(client, messages=QUESTION, tool_choice="required", **GREEDY).choices[0]
    assert len(many.message.tool_calls) >= 2
    for call in many.message.tool_calls:
        _valid(call)
    one = _chat(
        client, messages=QUESTION, tool_choice="required", parallel_tool_calls=False, **GREEDY
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_call_result_answer_loop_reuses_the_first_turn(client):
    messages = [{"role": "system", "content": "You are a helpful assistant."}, *QUESTION]
    first = _chat(client, messages=messages, tool_choice="required", **GREEDY)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        city = _valid(call).get("city", "?")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"Sunny in {city}"})
    second = _chat(client, messages=messages, tool_choice="none", **GREEDY)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the whole first turn, its call included
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_gives_text_or_valid_calls(client):
    out = _chat(
        client, messages=QUESTION, tool_choice="auto", n=4, temperature=1.0, seed=3, max_tokens=64
    )
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                _valid(call)
        else:
            assert choice.message.tool_calls is None and "<tool_call>" not in (
                choice.message.content or ""
            )


def test_none_never_calls(client):
    out = _chat(client, messages=QUESTION, tool_choice="none", max_tokens=24, temperature=0)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize(
    ("tools", "tool_choice", "message"),
    [
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "name must match"),
        ([{"type": "function"}], None, "function must be an object"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        (TOOLS, "sometimes", "tool_choice must be"),
    ],
)
def test_malformed_tools_get_400_with_a_message(client, tools, tool_choice, message):
    kwargs = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="default", messages=QUESTION, tools=tools, max_tokens=4, **kwargs
        )
    assert e.value.status_code == 400 and message in e.value.message
    assert e.value.code == "invalid_request"


def test_an_openai_agents_agent_calls_a_python_function(runtime):
    """openai-agents, unchanged, drives the server through Chat Completions: the model must call
    the tool on the first turn (tool_choice required, reset after the call), then answers."""
    run_weather_agent("OpenAIChatCompletionsModel", runtime.http_url, max_tokens=48)


@pytest.mark.parametrize("parser", ["hermes", "mistral", "pythonic"])
def test_streamed_reply_in_pieces_makes_first_deltas_then_arguments(parser):
    """No model: a reply fed a character at a time."""
    from radixrt.server.http.shapes import ToolCallStream
    from radixrt.structured.tools import PARSERS, ToolCall

    calls = [ToolCall("get_weather", '{"city":"Oslo"}'), ToolCall("add", '{"a":1,"b":2}')]
    text = "Let me see. " + PARSERS[parser].format_calls(calls)
    stream = ToolCallStream(PARSERS[parser])
    deltas = [d for c in text for d in stream.feed(c)] + stream.feed("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me see. " and stream.called
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    firsts = [p for p in pieces if "id" in p]
    assert [(p["index"], p["function"]) for p in firsts] == [
        (0, {"name": "get_weather", "arguments": ""}),
        (1, {"name": "add", "arguments": ""}),
    ]
    joined = [
        "".join(p["function"]["arguments"] for p in pieces if p["index"] == i) for i in (0, 1)
    ]
    assert joined == [c.arguments for c in calls]
