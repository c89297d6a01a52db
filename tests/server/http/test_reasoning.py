"""The reasoning parsers, model-free: whole replies, and the same replies streamed in pieces cut at
every position (tags split across deltas) joining to the whole split."""

from __future__ import annotations

import json

import pytest

from radixrt.server.http.reasoning import REASONING_PARSERS, ReasoningSplit, ReasoningStream

R1, QWEN3 = REASONING_PARSERS["deepseek-r1"], REASONING_PARSERS["qwen3"]

WHOLE = [
    # (parser, reply, reasoning, content)
    (R1, "Let me think.\n</think>\n\nIt is 4.", "Let me think.", "It is 4."),
    (R1, "<think>\nexplicit open</think>answer", "explicit open", "answer"),
    (R1, "cut off before the end", "cut off before the end", ""),
    (R1, "</think>no reasoning", "", "no reasoning"),
    (R1, "a < b </thin k> c</think> d", "a < b </thin k> c", "d"),
    (QWEN3, "<think>\nsteps\n</think>\n\nThe answer.", "steps", "The answer."),
    (QWEN3, "  <think>x</think>y", "x", "y"),
    (QWEN3, "No thinking here.", "", "No thinking here."),
    (QWEN3, "text then <think>late</think>", "", "text then <think>late</think>"),
    (QWEN3, "<think>never closed", "never closed", ""),
    (QWEN3, "<thin", "", "<thin"),
    (QWEN3, "", "", ""),
]


@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), WHOLE)
def test_whole_replies(parser, reply, reasoning, content):
    assert parser.split(reply) == ReasoningSplit(reasoning, content)


def _streamed(parser, pieces: list[str]) -> ReasoningSplit:
    stream = ReasoningStream(parser)
    outs = [stream.feed(p) for p in pieces] + [stream.feed("", final=True)]
    return ReasoningSplit("".join(o.reasoning for o in outs), "".join(o.content for o in outs))


@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), WHOLE)
def test_streams_cut_anywhere_join_to_the_whole_split(parser, reply, reasoning, content):
    whole = ReasoningSplit(reasoning, content)
    for cut in range(len(reply) + 1):
        assert _streamed(parser, [reply[:cut], reply[cut:]]) == whole, cut
    for first in range(len(reply) + 1):  # two cuts: a tag may be split in three
        for second in range(first, len(reply) + 1):
            pieces = [reply[:first], reply[first:second], reply[second:]]
            assert _streamed(parser, pieces) == whole, (first, second)
    assert _streamed(parser, list(reply)) == whole


def test_every_server_flag_value_has_a_parser_and_others_are_refused():
    from radixrt.config import REASONING_PARSER_NAMES, ServerArgs

    assert set(REASONING_PARSERS) == set(REASONING_PARSER_NAMES)
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerArgs(reasoning_parser="deepseek")


def test_a_stream_lets_text_out_as_soon_as_it_is_certain():
    stream = ReasoningStream(R1)
    assert stream.feed("step one") == ReasoningSplit("step one", "")
    assert stream.feed(" </th") == ReasoningSplit("", "")  # maybe the end tag: held
    assert stream.feed("ink>  ") == ReasoningSplit("", "")  # whitespace before the answer
    assert stream.feed("Four") == ReasoningSplit("", "Four")
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<th") == ReasoningSplit("", "")  # maybe <think>
    assert stream.feed("is is plain") == ReasoningSplit("", "<this is plain")


# ---- end to end: the default model thinks, then answers under a schema --------------------------
# The reply is prefilled with `<think>` (Anthropic's prefill, chat's continue_final_message), so it
# starts inside the block; the schema applies only after `</think>`, which the budget forces.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Rome"]}},
    "required": ["city"],
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = [*QUESTION, {"role": "assistant", "content": "<think>\n"}]
BUDGET, MAX_TOKENS = 12, 40


@pytest.fixture(scope="module")
def reasoning_runtime(runtimes, default_model_dir):
    with runtimes.lease(
        default_model_dir,
        http=True,
        reasoning_parser="deepseek-r1",
        max_total_tokens=4096,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def prefilled_prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(PREFILLED, tokenize=False, continue_final_message=True)


def _answer(split: ReasoningSplit) -> str:
    """The split's answer, checked: some reasoning, then JSON that the schema accepts."""
    assert split.reasoning, split
    assert json.loads(split.content)["city"] in ANSWER_SCHEMA["properties"]["city"]["enum"]
    return split.content


def test_a_schema_applies_after_the_reasoning_in_every_sample(
    reasoning_runtime, prefilled_prompt, tokenizer
):
    """50 sampled replies: each reasons freely (bounded by its budget), closes the block, and
    answers in JSON that parses; the budget is the reasoning's length at most."""
    out = reasoning_runtime.generate(
        prefilled_prompt,
        {
            "temperature": 1.0,
            "seed": 7,
            "n": 50,
            "max_new_tokens": MAX_TOKENS,
            "max_reasoning_tokens": BUDGET,
            "json_schema": ANSWER_SCHEMA,
        },
    )
    assert len(out) == 50
    for sample in out:
        _answer(R1.split(sample["text"]))
        reasoning = sample["text"].split("</think>")[0]
        assert len(tokenizer.encode(reasoning)) <= BUDGET + 2


def _greedy_split(runtime, prompt: str) -> ReasoningSplit:
    raw = runtime.generate(
        prompt,
        {
            "temperature": 0,
            "max_new_tokens": MAX_TOKENS,
            "max_reasoning_tokens": BUDGET,
            "json_schema": ANSWER_SCHEMA,
        },
    )["text"]
    split = R1.split(raw)
    _answer(split)
    return split


def test_chat_gets_the_reasoning_apart_and_the_answer_constrained(
    reasoning_runtime, prefilled_prompt
):
    import openai

    request = {
        "model": "default",
        "messages": PREFILLED,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": ANSWER_SCHEMA},
        },
        "extra_body": {"continue_final_message": True, "max_reasoning_tokens": BUDGET},
    }
    expected = _greedy_split(reasoning_runtime, prefilled_prompt)
    url = f"{reasoning_runtime.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0) as client:
        message = client.chat.completions.create(**request).choices[0].message
        chunks = list(client.chat.completions.create(**request, stream=True))
    assert (message.reasoning_content, message.content) == expected
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = ReasoningSplit(
        "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
        "".join(d.content or "" for d in deltas),
    )
    assert streamed == expected


def test_messages_get_the_reasoning_as_a_thinking_block(reasoning_runtime, prefilled_prompt):
    """Anthropic's Messages API on the same reply: a `thinking` block (its budget the
    reasoning's), then the answer's text block (output_config's schema is response_format's);
    streamed, the same blocks."""
    import anthropic

    request = {
        "model": "default",
        "max_tokens": MAX_TOKENS,
        "messages": PREFILLED,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        "output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}},
        "extra_body": {"temperature": 0},
    }
    expected = _greedy_split(reasoning_runtime, prefilled_prompt)
    with anthropic.Anthropic(
        base_url=reasoning_runtime.http_url, api_key="none", max_retries=0
    ) as client:
        whole = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            streamed = stream.get_final_message()
    for reply in (whole, streamed):
        thinking, text = reply.content
        assert (thinking.type, text.type) == ("thinking", "text")
        assert (thinking.thinking, text.text) == expected


def test_a_dsl_gen_reasons_then_matches_its_regex(reasoning_runtime, prefilled_prompt):
    import radixrt as rt

    @rt.function
    def ask(s):
        s += prefilled_prompt
        s += rt.gen(
            "answer", max_tokens=MAX_TOKENS, max_reasoning_tokens=BUDGET, regex="(Paris|Rome)"
        )

    reply = ask.run(backend=reasoning_runtime, temperature=0)["answer"]
    reasoning, answer = R1.split(reply)
    assert reasoning and answer in ("Paris", "Rome")


def test_a_budget_needs_a_reasoning_parser(tiny_runtime):
    from radixrt.client.transport import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="max_reasoning_tokens needs"):
        tiny_runtime.generate("hi", {"max_new_tokens": 4, "max_reasoning_tokens": 2})


def test_a_streamed_choice_reads_calls_from_the_answer_only():
    """Reasoning first, then the answer through the tool-call reader: a call written inside the
    think block is reasoning, the one after it a call."""
    from radixrt.server.http.shapes import ChoiceStream, ReasoningStream, ToolCallStream
    from radixrt.structured.tools import PARSERS

    call = '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>'
    reply = f"maybe {call}?</think>{call}"
    stream = ChoiceStream(ReasoningStream(R1), ToolCallStream(PARSERS["hermes"]))
    deltas = [d for ch in reply for d in stream.feed(ch)] + stream.feed("", final=True)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == f"maybe {call}?" and stream.called
    assert not any("content" in d for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "f"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"x": 1}
