"""`rt.chat`: one chat turn with OpenAI-style messages and tools over any backend (`Engine`,
`Runtime`, `RuntimeEndpoint`), rendered and constrained as `/v1/chat/completions` does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixrt.client.base import Endpoint
from radixrt.structured.tools import ToolCall, prompt_messages, template_renders_tools

from .chat_template import ChatTemplate, render_messages
from .function import backend_or_default
from .openai_backend import OpenAI
from .tools import ToolRequest


@dataclass(frozen=True)
class ChatReply:
    """One assistant turn: its text (None when it only calls), its calls, why it ended
    (`tool_calls` when it called) and the runtime's meta info."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    meta_info: dict[str, Any]

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI-style assistant message, to append to the history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message


def chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    tool_call_parser: str = "auto",
    backend: Endpoint | None = None,
    **sampling_params: Any,
) -> ChatReply:
    """One chat turn with OpenAI-style `messages` (tool calls and `tool` results included) and
    `tools`, rendered and constrained as `/v1/chat/completions` does, on `backend` (default: the
    default backend); `sampling_params` are the runtime's (`max_new_tokens`, `temperature`, ...)."""
    endpoint = backend_or_default(backend)
    if isinstance(endpoint, OpenAI):
        raise ValueError("rt.chat needs a radixrt backend; with rt.OpenAI, call its client.chat")
    info = endpoint.model_info
    request = ToolRequest.of(
        endpoint, tools or [], tool_choice, parallel_tool_calls, tool_call_parser
    )
    template = info.get("chat_template")
    rendered = [t.to_openai() for t in request.tools] if template_renders_tools(template) else None
    prompt = render_messages(
        info, prompt_messages(messages, request.tools, request.parser, template), rendered
    )
    params = dict(sampling_params)
    if request.constraint is not None:
        params.update(request.constraint.params())
    suffix = ChatTemplate.from_model_info(info).suffix("assistant").strip()
    if suffix:
        params.setdefault("stop_token_ids", endpoint.tokenize(suffix)[:1])
    out = endpoint.generate(prompt, params)
    assert isinstance(out, dict), "one prompt, one sample"
    content, calls = request.read(out["text"])
    finish = "tool_calls" if calls else out["meta_info"]["finish_reason"]["type"]
    return ChatReply(content.strip() or None if calls else content, calls, finish, out["meta_info"])
