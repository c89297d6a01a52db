"""Chat templates rendered without transformers (radixrt/client/chat_render.py, what the HTTP
gateway's render processes run): the same prompts as `apply_chat_template` for ordinary
templates (tools, reasoning, continue_final_message, template variables, transformers' helpers),
the same refusals, and the bounds of the sandbox (repetition, concatenation, widths, `range`,
the output) refused at once by name, with no attribute escape."""

from __future__ import annotations

import time

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from radixrt.client.chat_render import (
    ERROR,
    LIMIT,
    RANGE_PER_RENDER,
    Renderer,
    RenderJob,
    TemplateLimitError,
    answer,
)
from radixrt.server.http.schemas import ChatRendering, chat_job, render_chat

CHATML = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a Qwen3-style template: tools as JSON, tool calls, reasoning, namespace, loop controls,
# raise_exception, the generation tag, a reversed scan of the messages
TOOLS_AND_REASONING = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == "user" and message.content is string %}{% set ns.last_query = index %}{% break %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + message.role) }}{% endif %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% generation %}
{%- if message.reasoning_content and loop.index0 > ns.last_query %}<think>
{{ message.reasoning_content.strip('\\n') }}
</think>

{% endif %}{{ message.content | default('', true) }}
{%- for call in message.tool_calls | default([]) %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}{% endgeneration %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
# Llama 3 style: strftime_now, tojson with indent, dict(), string methods, a joined list
LLAMA3ISH = """{{- bos_token }}
{%- set date_string = strftime_now("%Y") %}
{%- set d = dict(a=1, b=[1, 2]) %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nYear " + (date_string|length)|string + " " + d|tojson(indent=2) }}
{%- if tools is not none %}{% for t in tools %}{{ t | tojson(indent=4) }}{{ "\\n\\n" }}{% endfor %}{% endif %}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim | replace('  ', ' ') + ' ' ~ [message.role, 'x'] | join('/') + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}
{{- '%-8s|' % 'end' }}{{ '{:>6}'.format('r') }}{{ 'z'.center(7) }}{{ 3 * 'ab' }}{{ range(3)|list|length }}"""
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather <now> & "later"',
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <|im_end|> there"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "\nThe user greets.\n"},
        {"role": "user", "content": "Weather in Paris? ünïcödé ✓"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": None},
        {"role": "assistant", "content": "It is", "thinking": "sunny, so"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return PreTrainedTokenizerFast.from_pretrained(default_model_dir)


def _reference(tokenizer, messages, tools, rendering: ChatRendering) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=not rendering.continue_final_message,
        continue_final_message=rendering.continue_final_message,
        **rendering.template_kwargs,
    )


@pytest.mark.parametrize("template", [None, CHATML, TOOLS_AND_REASONING, LLAMA3ISH])
def test_prompts_equal_apply_chat_template(tokenizer, template):
    """Every conversation, with and without tools, continued or not, with template variables:
    the same text as transformers renders, or an error where transformers raises one."""
    if template is not None:
        tokenizer.chat_template = template
    compared = 0
    for messages in CONVERSATIONS:
        for tools in (None, [TOOL]):
            for rendering in (
                ChatRendering(),
                ChatRendering(template_kwargs={"greeting": "Bonjour", "enable_thinking": False}),
                ChatRendering(continue_final_message=True),
            ):
                try:
                    want = _reference(tokenizer, messages, tools, rendering)
                except (jinja2.TemplateError, ValueError, TypeError) as e:
                    with pytest.raises(type(e)):
                        render_chat(tokenizer, messages, tools, rendering)
                    continue
                assert render_chat(tokenizer, messages, tools, rendering) == want
                compared += 1
    assert compared >= 12


def test_template_errors_are_the_templates(tokenizer):
    """raise_exception's message, a syntax error and the sandbox's refusals come back as ERROR
    verdicts with the template's words."""
    renderer = Renderer()
    cases = {
        "{{ raise_exception('roles must alternate') }}": "roles must alternate",
        "{% if %}": "Expected an expression",
        "{{ ''.__class__.__mro__ }}": "unsafe",
        "{{ cycler.__init__.__globals__ }}": "unsafe",
        "{{ namespace.__init__.__globals__ }}": "unsafe",
        "{% set ns = namespace(_x=1) %}": "underscore-prefixed",
        "{{ messages.append(1) }}": "unsafe",
        "{{ messages[0].content.format.__globals__['sys'] }}": "unsafe",
    }
    for template, words in cases.items():
        reply = answer(RenderJob(template, [{"role": "user", "content": "x"}]).to_json(), renderer)
        assert reply[:1] == ERROR and words in reply.decode(), (template, reply)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a' * 1500000000 }}",
        "{{ 1500000000 * 'a' }}",
        "{{ [0] * 1500000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{{ 7 ** 100000000 }}",
        "{{ 'a'.ljust(1500000000) }}",
        "{{ 'a'|center(1500000000) }}",
        "{{ 'a'|indent(1500000000, true) }}",
        "{{ '%1500000000s' % 'a' }}",
        "{{ '%*s'|format(1500000000, 'a') }}",
        "{{ '{:>1500000000}'.format('a') }}",
        "{{ 'abc'.replace('', 'x' * 4000000) }}",
        "{{ (['x' * 4000000] * 100)|join }}",
        "{{ 'x'.join(['y' * 4000000] * 100) }}",
        "{{ {'a': 1}|tojson(indent=1500000000) }}",
        "{{ range(1500000000) }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ lipsum(1500000000) }}",
        "{{ [1, 2]|batch(1500000000, 0)|list }}",
        "{{ 'a' * 3000 }}",  # past this job's output limit (1 KiB)
        "{% for i in range(3000) %}a{% endfor %}",
    ],
)
def test_bombs_are_refused_at_once_by_name(template):
    start = time.perf_counter()
    job = RenderJob(template, [{"role": "user", "content": "x"}], max_bytes=1024)
    reply = answer(job.to_json(), Renderer())
    assert reply[:1] == LIMIT, reply[:300]
    assert time.perf_counter() - start < 1.0
    assert b"at most" in reply or str(RANGE_PER_RENDER).encode() in reply or b"over" in reply


def test_the_output_limit_is_the_prompt_in_bytes():
    """Exactly max_bytes of UTF-8 renders; one byte more is refused; the limit counts bytes,
    not characters."""
    renderer = Renderer()
    assert len(renderer.render(RenderJob("{{ 'a' * 1024 }}", [], max_bytes=1024))) == 1024
    with pytest.raises(TemplateLimitError, match="max-prompt-bytes"):
        renderer.render(RenderJob("{{ 'a' * 1024 }}!", [], max_bytes=1024))
    with pytest.raises(TemplateLimitError, match="max-prompt-bytes"):
        renderer.render(RenderJob("{{ 'é' * 600 }}", [], max_bytes=1024))


def test_a_job_round_trips_through_json(tokenizer):
    """The worker's job carries what the renderer needs, lone surrogates included."""
    tokenizer.chat_template = CHATML
    messages = [{"role": "user", "content": "a \ud800 b"}]
    job = chat_job(tokenizer, messages, None, ChatRendering(template_kwargs={"greeting": "G"}))
    assert RenderJob.from_json(job.to_json()) == job
    assert job.variables["greeting"] == "G" and job.variables["eos_token"] == tokenizer.eos_token
