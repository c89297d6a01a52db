"""Role prefixes and suffixes derived from the model's own Jinja chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixrt.client.chat_render import RenderJob, render

_MARK = "\x00RADIXRT\x00"
# the prompt a program may build here: the server bounds what it takes (--max-prompt-bytes)
_MAX_PROMPT_BYTES = 1 << 30


@dataclass
class ChatTemplate:
    prefixes: dict[str, str]
    suffixes: dict[str, str]
    default_system: str  # what the template puts before a first message that is not a system one

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> ChatTemplate:
        if not info.get("chat_template"):
            return cls({}, {}, "")

        def render(messages: list[dict[str, Any]]) -> str:
            return render_messages(info, messages, add_generation_prompt=False)

        def around(before: list[dict[str, Any]], role: str) -> tuple[str, str]:
            head = render(before) if before else ""
            text = render(before + [{"role": role, "content": _MARK}])
            prefix, suffix = text[len(head) :].split(_MARK)
            return prefix, suffix

        system = around([], "system")
        user = around([{"role": "system", "content": "S"}], "user")
        assistant = around(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "assistant"
        )
        lone_user = render([{"role": "user", "content": _MARK}])
        default_system = lone_user[: lone_user.index(_MARK)].removesuffix(user[0])
        return cls(
            {"system": system[0], "user": user[0], "assistant": assistant[0]},
            {"system": system[1], "user": user[1], "assistant": assistant[1]},
            default_system,
        )

    def prefix(self, role: str) -> str:
        return self.prefixes.get(role, "")

    def suffix(self, role: str) -> str:
        return self.suffixes.get(role, "")


def render_messages(
    info: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Messages (and, for a template that renders them, tools) as the model's own chat template
    writes them, as the HTTP gateway renders them (transformers' helpers, in the bounded
    sandbox of `radixrt.client.chat_render`); `info` is the runtime's `model_info`."""
    job = RenderJob(
        info["chat_template"],
        messages,
        tools,
        variables=dict(info.get("special_tokens", {})),
        add_generation_prompt=add_generation_prompt,
        max_bytes=_MAX_PROMPT_BYTES,
    )
    return render(job)
