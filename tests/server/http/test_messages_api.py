"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official
`anthropic` SDK, unchanged, against one server on the default model: a reply whole and streamed
(the same text, Anthropic's event sequence), stop reasons, a tool_use -> tool_result round trip
under the always-parsing tool constraint, count_tokens, a five-turn conversation read back from
the radix cache, and bad input answered in Anthropic's error shape while the server serves on.

This SDK version has no `temperature` argument: greedy requests send it through `extra_body`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest

from timeouts import REPLY_TIMEOUT_S

GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = [{"role": "user", "content": "Name a river in Europe."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "cache_control": {"type": "ephemeral"},  # accepted: every prefix is cached anyway
}


@pytest.fixture(scope="module")
def runtime(default_runtime):
    return default_runtime


@pytest.fixture(scope="module")
def client(runtime):
    with anthropic.Anthropic(
        base_url=runtime.http_url, api_key="unused", max_retries=0, timeout=REPLY_TIMEOUT_S
    ) as c:
        yield c


def _raw_events(runtime, body: dict) -> list[tuple[str, dict]]:
    """A streamed reply's server-sent events as (event name, data), read off the socket (the
    SDK drops `ping`)."""
    request = urllib.request.Request(
        f"{runtime.http_url}/v1/messages",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json", "x-api-key": "unused"},
    )
    with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
        text = response.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_a_streamed_reply_is_the_whole_reply_in_anthropics_events(runtime, client):
    body = {"model": "default", "max_tokens": 24, "system": "Be brief.", "messages": QUESTION}
    whole = client.messages.create(**body, **GREEDY)
    (block,) = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.id.startswith("msg_") and whole.role == "assistant"
    with client.messages.stream(**body, **GREEDY) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(texts) == streamed.content[0].text == block.text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == prompt
    events = _raw_events(runtime, {**body, "temperature": 0})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    deltas = names[3:-3]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert deltas and set(deltas) == {"content_block_delta"}
    assert "".join(data["delta"]["text"] for _, data in events[3:-3]) == block.text


def test_stop_reasons(client):
    whole = (
        client.messages.create(model="default", max_tokens=24, messages=QUESTION, **GREEDY)
        .content[0]
        .text
    )
    word = whole.split()[2]
    stopped = client.messages.create(
        model="default", max_tokens=24, messages=QUESTION, stop_sequences=[word], **GREEDY
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == whole[: whole.index(word)]
    short = client.messages.create(model="default", max_tokens=2, messages=QUESTION, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_tool_use_round_trip(client):
    """`any` (one call): every call parses and validates (the chat path's constraint); streamed, the
    input_json_delta pieces join to the same input; the tool_result turn reads the whole first
    turn from the cache."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = {"model": "default", "max_tokens": 48, "tools": [WEATHER], **GREEDY}
    one = {"type": "any", "disable_parallel_tool_use": True}
    first = client.messages.create(**call, messages=ask, tool_choice=one)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and all(
        u.name == "get_weather" and u.id.startswith("toolu_") for u in uses
    )
    for use in uses:
        jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(**call, messages=ask, tool_choice=one) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(u.name, u.input) for u in uses]
    results = [
        {"type": "tool_result", "tool_use_id": u.id, "content": f"Sunny in {u.input['city']}"}
        for u in uses
    ]
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": results},
    ]
    answer = client.messages.create(**call, messages=history, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens >= first_prompt


def test_count_tokens_is_the_prompt_a_reply_reports(client):
    body = {
        "model": "default",
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": QUESTION,
        "tools": [WEATHER],
    }
    counted = client.messages.count_tokens(**body).input_tokens
    usage = client.messages.create(**body, max_tokens=1, **GREEDY).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens > 0


def test_five_turns_read_their_history_from_the_cache(client):
    """Every turn after the first reads at least 90% of the turn before's prompt from the radix
    cache (cache_read_input_tokens), as an agent loop resending its history does."""
    history: list[dict] = []
    previous_prompt = None
    for turn in range(5):
        history.append({"role": "user", "content": f"Tell me one fact about the number {turn}."})
        reply = client.messages.create(
            model="default", max_tokens=8, system="Be brief.", messages=history, **GREEDY
        )
        usage = reply.usage
        if previous_prompt is not None:
            assert usage.cache_read_input_tokens >= 0.9 * previous_prompt, (turn, usage)
        previous_prompt = usage.input_tokens + usage.cache_read_input_tokens
        history.append({"role": "assistant", "content": reply.content[0].text})


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
BAD = [
    # (body change, what the message must name)
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "wat"}]}]}, "'wat'"),
    ({"frequency": 1}, "unknown field 'frequency'"),
    ({"max_tokens": None}, "max_tokens"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}],
                }
            ]
        },
        "no tool_use block",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        "tool_use block cannot be in a user message",
    ),
    (
        {
            "messages": [
                *QUESTION,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                },
                {"role": "user", "content": "and?"},
            ]
        },
        "no tool_result block",
    ),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "needs a name"),
]


@pytest.mark.parametrize(("change", "named"), BAD)
def test_bad_input_gets_anthropics_error_shape(runtime, client, change, named):
    body = {"model": "default", "max_tokens": 4, "messages": QUESTION, **change}
    request = urllib.request.Request(
        f"{runtime.http_url}/v1/messages",
        json.dumps({k: v for k, v in body.items() if v is not None}).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S)
    assert e.value.code == 400
    error = json.loads(e.value.read())
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    ok = client.messages.create(model="default", max_tokens=2, messages=QUESTION, **GREEDY)
    assert ok.usage.output_tokens == 2  # the server serves on


def test_the_sdk_reads_the_errors_as_anthropics(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}]
        )
    assert e.value.status_code == 400 and "image blocks are not supported" in e.value.message
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"


# ---- model-free: the translation into chat messages, and the blocks of a reply in pieces -------


def test_a_tool_round_trip_becomes_chat_messages():
    from radixrt.server.http.anthropic_messages import MessagesPrompt, chat_messages, chat_request

    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "Rain"}],
    }
    prompt = MessagesPrompt.model_validate(
        {
            "model": "m",
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "user", "content": "In Oslo."},  # one turn with the message before
                {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, use]},
                {"role": "user", "content": [result, {"type": "text", "text": "Thanks."}]},
                {"role": "assistant", "content": "It"},  # a prefill
            ],
        }
    )
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    assert chat_messages(prompt) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?\n\nIn Oslo."},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Rain"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "It"},
    ]
    assert chat_request(prompt, None).continue_final_message


def test_reply_blocks_streamed_in_pieces_are_the_whole_replys():
    """A reply (reasoning, text, two calls) fed a character at a time: the events build the
    same blocks as the whole reply, each block opened, grown and closed in order."""
    from radixrt.server.http.anthropic_messages import BlockStream
    from radixrt.server.http.reasoning import REASONING_PARSERS
    from radixrt.server.http.shapes import ChoiceStream, ReasoningStream, ToolCallStream
    from radixrt.structured.tools import PARSERS, ToolCall

    calls = [ToolCall("get_weather", '{"city":"Oslo"}'), ToolCall("add", '{"a":1,"b":2}')]
    reply = "Hmm.</think>Let me see. " + PARSERS["hermes"].format_calls(calls)

    def stream() -> BlockStream:
        reasoning = ReasoningStream(REASONING_PARSERS["deepseek-r1"])
        return BlockStream(ChoiceStream(reasoning, ToolCallStream(PARSERS["hermes"])))

    whole = stream()
    whole.feed(reply, final=True)
    pieces = stream()
    events = [e for c in reply for e in pieces.feed(c)] + pieces.feed("", final=True)
    strip = [{k: v for k, v in b.items() if k != "id"} for b in whole.blocks()]
    assert strip == [{k: v for k, v in b.items() if k != "id"} for b in pieces.blocks()]
    assert [b["type"] for b in strip] == ["thinking", "text", "tool_use", "tool_use"]
    assert strip[0]["thinking"] == "Hmm." and strip[1]["text"] == "Let me see. "
    assert [(b["name"], b["input"]) for b in strip[2:]] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": 1, "b": 2}),
    ]
    opened = [e["index"] for e in events if e["type"] == "content_block_start"]
    closed = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert opened == closed == [0, 1, 2, 3] and pieces.called
    json_pieces = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 3
    ]
    assert "".join(json_pieces) == '{"a":1,"b":2}'
