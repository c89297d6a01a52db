"""Tools in the DSL and `rt.chat`, on the tiny random model (whose choices are noise, which the
constraint must still turn into valid calls): `gen(tools=...)` gives parsed calls, a chat loop
renders calls and results back so the next turn's prefix is cached."""

from __future__ import annotations

import jsonschema
import pytest

import radixrt as rt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {
                    "key": {"type": "string", "maxLength": 8},
                    "limit": {"type": "integer"},
                },
                "required": ["key", "limit"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {"lookup": TOOLS[0]["function"]["parameters"], "now": {"type": "object"}}


@pytest.fixture(scope="module")
def runtime(tiny_runtime):
    return tiny_runtime


def _check(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])


@rt.function
def call_program(s, choice):
    s += rt.system("Tools.\n\n" + rt.tools_prompt(TOOLS))
    s += rt.user("Look it up.")
    s += rt.assistant(rt.gen("call", tools=TOOLS, tool_choice=choice, max_tokens=48))


@pytest.mark.parametrize("choice", ["required", "lookup"])
def test_gen_with_tools_gives_parsed_valid_calls(runtime, choice):
    # seeded: unseeded noise now and then spends max_tokens on a long integer before the call
    # closes, and a cut call parses to none
    states = call_program.run_batch(
        [{"choice": choice, "seed": i} for i in range(4)],
        backend=runtime,
        temperature=1.0,
        progress_bar=False,
    )
    for state in states:
        calls = state["call"]
        _check(calls)
        if choice == "lookup":
            assert {c["name"] for c in calls} == {"lookup"}
        assert state.get_meta_info("call")["content"] == ""
        assert "<tool_call>" in state.text()  # the call's text stays in the program's text


def test_chat_loop_renders_history_and_reuses_the_first_turn(runtime):
    messages = [{"role": "user", "content": "Look it up."}]
    first = rt.chat(
        messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        backend=runtime,
        max_new_tokens=48,
        temperature=0,
    )
    assert first.finish_reason == "tool_calls" and len(first.tool_calls) == 1
    assert first.content is None
    messages.append(first.message())
    call = first.tool_calls[0]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "found 3"})
    second = rt.chat(messages, tools=TOOLS, tool_choice="none", backend=runtime, max_new_tokens=8)
    assert second.tool_calls == [] and second.finish_reason in ("stop", "length")
    assert second.meta_info["cached_tokens"] >= first.meta_info["prompt_tokens"]
    with pytest.raises(ValueError, match="not among the tools"):
        rt.chat(messages, tools=TOOLS, tool_choice={"function": {"name": "x"}}, backend=runtime)
