"""Tool calls without a model: the tools' checks, each call format's regex (walked with
outlines-core, so in the Rust dialect the runtime compiles), reading calls back whole and as a
stream grows, and the history rendered into the next prompt."""

from __future__ import annotations

import json
import re
import time

import pytest
from outlines_core import Index, Vocabulary

from radixrt.structured.patterns import Constraint
from radixrt.structured.tools import (
    HERMES,
    PARSERS,
    ToolCall,
    ToolChoice,
    ToolError,
    avoiding,
    parse_tool_choice,
    parse_tools,
    prompt_messages,
    resolve_parser,
)

from helpers import ref_fan_out

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = parse_tools([WEATHER, ADD, NOW])
CALLS = [
    ToolCall("get_weather", '{"city":"Paris","unit":"c"}'),
    ToolCall("add", '{"a":1,"b":-2}'),
    ToolCall("now", "{}"),
]
# one token per printable ASCII character and newline, so a walk reads text character by character
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
_VOCABULARY = Vocabulary(len(_CHARS), {c.encode(): [i] for i, c in enumerate(_CHARS)})


def accepts(constraint: Constraint | str, text: str) -> bool:
    """Whether the runtime's constraint (a regex, anchored as the compiler anchors it) accepts
    `text` whole."""
    if isinstance(constraint, Constraint):
        assert constraint.kind == "regex"
        constraint = constraint.value
    index = Index(f"(?:{constraint})\\z", _VOCABULARY)
    state = index.get_initial_state()
    for c in text:
        state = index.get_next_state(state, _CHARS.index(c))
        if state is None:
            return False
    return index.is_final_state(state)


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_written_calls_match_the_constraint_and_read_back(parser):
    p = PARSERS[parser]
    text = p.format_calls(CALLS)
    for mode in ("required", "auto"):
        assert accepts(p.constraint(TOOLS, ToolChoice(mode), parallel=True), text)
    assert accepts(p.constraint(TOOLS, ToolChoice("auto"), True), "Let me check. " + text)
    scan = p.scan("Let me check. " + text, final=True)
    assert scan.content == "Let me check. "
    read = scan.finished_calls()
    assert [(c.name, json.loads(c.arguments)) for c in read] == [
        (c.name, json.loads(c.arguments)) for c in CALLS
    ]


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_constraints_refuse_invalid_calls(parser):
    p = PARSERS[parser]
    one = p.constraint(TOOLS, ToolChoice("required"), parallel=False)
    assert accepts(one, p.format_calls(CALLS[:1]))
    assert not accepts(one, p.format_calls(CALLS[:2]))  # parallel_tool_calls=false: one call
    named = p.constraint(TOOLS, ToolChoice("function", "add"), parallel=False)
    assert accepts(named, p.format_calls(CALLS[1:2]))
    assert not accepts(named, p.format_calls(CALLS[:1]))
    bad_arguments = ['{"city":3}', '{"unit":"c"}', '{"city":"Paris","unit":"k"}']
    if parser != "pythonic":  # it writes arguments from their values
        bad_arguments.append('{"city":"P"')
    for bad in bad_arguments:
        call = p.format_calls([ToolCall("get_weather", bad)])
        assert not accepts(one, call)
        assert not accepts(p.constraint(TOOLS, ToolChoice("auto"), True), "Sure: " + call)
    assert p.constraint(TOOLS, ToolChoice("none"), True) is None


def test_auto_free_text_never_holds_the_trigger():
    free = avoiding("<tool_call>")
    for text in ("plain", "a < b", "<tool", "<tool_cal", "x<<tool_x", "<tool_call<", "<"):
        assert accepts(free, text), text
    for text in ("<tool_call>", "hi <tool_call> there", "<<tool_call>"):
        assert not accepts(free, text), text
    assert not accepts(free, "")  # auto needs some reply: the compiler's anchor
    with pytest.raises(ValueError):
        avoiding("abca")


@pytest.mark.parametrize("parser", ["hermes", "llama3-json", "mistral"])
def test_streamed_scans_grow_into_the_final_calls(parser):
    """Every prefix's scan is a prefix of the next one's: content only grows, a call's name
    appears once whole, its arguments only grow, and they end as the final read."""
    p = PARSERS[parser]
    text = "Checking. " + p.format_calls(CALLS)
    before = p.scan("", final=False)
    for end in range(1, len(text) + 1):
        now = p.scan(text[:end], final=False)
        assert now.content.startswith(before.content)
        assert len(now.calls) >= len(before.calls)
        for old, new in zip(before.calls, now.calls):
            assert old.name is None or old.name == new.name
            assert new.arguments.startswith(old.arguments)
        before = now
    final = p.scan(text, final=True)
    assert before == final and all(c.done for c in final.calls)
    assert [c.arguments for c in final.calls] == [c.arguments for c in CALLS]


def test_streaming_holds_back_what_may_begin_the_trigger():
    assert HERMES.scan("Hello <tool_c", final=False).content == "Hello "
    assert HERMES.scan("Hello <tool_c", final=True).content == "Hello <tool_c"
    assert HERMES.scan("a <b", final=False).content == "a <b"


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "has space"}}], "name must match"),
        ([NOW, NOW], "a second tool"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "type object",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {}}},
                    },
                }
            ],
            "tools[0].function.parameters",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"n": {"type": "array", "uniqueItems": True}},
                        },
                    },
                }
            ],
            "at $.properties.n: 'uniqueItems' cannot be enforced",
        ),
    ],
)
def test_malformed_tools_are_refused_with_the_reason(tools, message):
    with pytest.raises(ToolError, match=re.escape(message)):
        parse_tools(tools)


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_tool_schemas_are_bounded_by_one_expansion_budget_before_translation():
    """Tools are translated on the gateway's event loop: a `$ref` fan-out is refused by the
    expansion budget before any translation, and so are many tools each within it but over it
    together; with a keyword only a grammar enforces, the tools render as Lark (no expansion)."""
    for tools in (
        [_tool("f", ref_fan_out(64))],
        [_tool(f"f{i}", ref_fan_out(8)) for i in range(50)],
    ):
        start = time.monotonic()
        with pytest.raises(ToolError, match="expansion budget"):
            parse_tools(tools)
        assert time.monotonic() - start < 0.5
    assert len(parse_tools([_tool(f"f{i}", ref_fan_out(8)) for i in range(3)])) == 3
    bounded = {**ref_fan_out(64), "minProperties": 1}
    tools = parse_tools([_tool("f", bounded)])
    assert HERMES.constraint(tools, ToolChoice("required"), False).kind == "lark"


def test_tool_choice():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    named = {"type": "function", "function": {"name": "add"}}
    assert parse_tool_choice(named, TOOLS) == ToolChoice("function", "add")
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes", 3):
        with pytest.raises(ToolError):
            parse_tool_choice(bad, TOOLS)
    with pytest.raises(ToolError):
        parse_tool_choice("required", [])


def test_parser_auto_follows_the_template():
    assert resolve_parser("auto", None) is HERMES
    assert resolve_parser("auto", "{{ messages }}") is HERMES
    assert resolve_parser("auto", "{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert resolve_parser("auto", '{% if tools %}"parameters"{% endif %}').name == "llama3-json"
    assert resolve_parser("pythonic", None).name == "pythonic"
    with pytest.raises(ValueError):
        resolve_parser("xml", None)


def test_history_renders_calls_as_written_and_results_as_one_user_turn():
    calls = [c.to_openai() for c in CALLS[:2]]
    history = [
        {"role": "user", "content": "Weather in Paris, and 1 + -2?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "-1"},
    ]
    out = prompt_messages(history, TOOLS, HERMES, template=None)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == HERMES.format_calls(CALLS[:2])
    assert out[3]["content"].count("<tool_response>") == 2 and "sunny" in out[3]["content"]
    kept = prompt_messages(history, TOOLS, HERMES, template="{% for t in tools %}{% endfor %}")
    assert kept[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}


def test_the_flag_offers_every_parser():
    from dataclasses import fields

    from radixrt.config import ServerArgs
    from radixrt.structured.tools import PARSER_NAMES

    (flag,) = [f for f in fields(ServerArgs) if f.name == "tool_call_parser"]
    assert tuple(flag.metadata["choices"]) == PARSER_NAMES
    assert set(PARSER_NAMES) == {"auto", *PARSERS}
