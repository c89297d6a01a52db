"""Tools in programs: `gen(name, tools=[...], tool_choice=...)` decodes under the same call
constraint as the HTTP API and sets `state[name]` to the parsed calls; `tools_prompt` writes the
default tools block for a system message. (`rt.chat`, a chat turn with tools, is in chat.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixrt.client.base import Endpoint
from radixrt.structured.patterns import Constraint
from radixrt.structured.tools import (
    PARSERS,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    parse_tool_choice,
    parse_tools,
    resolve_parser,
    tools_system_prompt,
)


@dataclass(frozen=True)
class ToolRequest:
    """A generation's tools: the parser its model writes calls with and the constraint it
    decodes under (None under `tool_choice="none"`)."""

    tools: list[Tool]
    choice: ToolChoice
    parser: ToolCallParser
    constraint: Constraint | None

    @classmethod
    def of(
        cls,
        backend: Endpoint,
        tools: list[dict[str, Any]],
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str = "auto",
    ) -> ToolRequest:
        """ValueError (a ToolError) for malformed tools or tool_choice."""
        parsed = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, parsed)
        parser = resolve_parser(tool_call_parser, backend.model_info.get("chat_template"))
        return cls(parsed, choice, parser, parser.constraint(parsed, choice, parallel_tool_calls))

    def read(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's content (the text before any calls) and its finished calls."""
        if self.constraint is None:
            return text, []
        scan = self.parser.scan(text, final=True)
        return scan.content, scan.finished_calls()


def parsed_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as a program reads them: `{"name", "arguments"}` with the arguments decoded."""
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


def tools_prompt(tools: list[dict[str, Any]], parser: str = "hermes") -> str:
    """The default tools block (signatures and how to call) to put in a program's system message."""
    return tools_system_prompt(parse_tools(tools), PARSERS[parser])
