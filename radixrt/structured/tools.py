"""Tool calls (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): the tools' checks, the call
formats models write (`--tool-call-parser`), the constraint under which every call parses and
validates (a regex, or a Lark grammar when a tool's schema has keywords only llguidance enforces),
reading calls back (whole or as a stream grows), and rendering calls and tool results into the
next prompt. No torch: the HTTP gateway and the DSL use it.

How `tool_choice` constrains the output (one constraint over the whole reply, so the guarantee holds
token by token and jump-forward applies to the forced names and keys):
- `required` / a named function: the calls section only (one call, or one or more when
  `parallel_tool_calls`), each call `{"name": <a tool>, "arguments": <that tool's schema>}`.
- `auto`: free text that never contains the parser's trigger (e.g. `<tool_call>`), optionally
  followed by the calls section. The moment the model has written the trigger, the only way on
  is a valid call, so no invalid call can reach the client; text may precede the calls.
- `none`: no constraint and no parsing.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from radixrt.structured.patterns import (
    Constraint,
    Json,
    Lit,
    Opt,
    Pattern,
    Re,
    Star,
    alt,
    literal,
    render,
    seq,
)
from radixrt.structured.regexes import (
    MAX_REGEX_CHARS,
    check_expansion,
    check_schema,
    load_schema,
    needs_grammar,
)

PARSER_NAMES = ("auto", "hermes", "llama3-json", "mistral", "pythonic")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CLASS_SPECIALS = set("\\]^-[&~")


class ToolError(ValueError):
    """A malformed `tools` / `tool_choice` (HTTP 400, code `invalid_request`)."""


@dataclass(frozen=True)
class Tool:
    """A function tool; `parameters` is the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any]
    description: str = ""
    strict: bool = False

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}

    @property
    def arguments(self) -> Pattern:
        """Arguments per the schema; a tool without properties takes exactly `{}`."""
        if not self.parameters.get("properties"):
            return Lit("{}")
        return Json(self.parameters)


def parse_tools(tools: list[Any]) -> list[Tool]:
    """OpenAI's `tools` list → Tools; ToolError names the first malformed entry and why (a bad
    name, a duplicate, parameters that are not an object schema or too complex to constrain).
    Each tool's schema is translated here (the gateway calls this in a worker thread, not on its
    event loop), so first the tools' schemas are checked, then, where they render as one regex, their `$ref` expansions together
    against one budget (`check_expansion`): no translation starts past it, and all of them cost
    at most one budget's worth."""
    parsed: list[Tool] = []
    for i, entry in enumerate(tools):
        parsed.append(_parse_tool(i, entry, parsed))
    schemas = [t.parameters for t in parsed if isinstance(t.arguments, Json)]
    if not any(needs_grammar(s) for s in schemas):  # else a Lark grammar: no $ref is expanded
        left = MAX_REGEX_CHARS
        for i, tool in enumerate(parsed):
            if isinstance(tool.arguments, Json):
                try:
                    left -= check_expansion(tool.parameters, left)
                except ValueError:
                    raise ToolError(
                        f"tools[{i}].function.parameters: with the tools before it, too large "
                        f"once $refs are expanded: their regex would take over {MAX_REGEX_CHARS} "
                        "chars (the expansion budget); share less through $ref or offer fewer tools"
                    ) from None
    for i, tool in enumerate(parsed):
        try:  # translated now, so a schema outlines-core cannot read is the caller's 400
            render(tool.arguments)
        except ValueError as e:
            raise ToolError(f"tools[{i}].function.parameters: {e}") from None
    return parsed


def _parse_tool(i: int, entry: Any, parsed: list[Tool]) -> Tool:
    """`tools[i]` → a Tool with its schema checked (not yet translated); ToolError names what is
    wrong, a name among `parsed` (the tools before it) included."""
    where = f"tools[{i}]"
    if not isinstance(entry, dict) or entry.get("type", "function") != "function":
        raise ToolError(f'{where}: only {{"type": "function", "function": {{...}}}} is supported')
    function = entry.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}, not {name!r}")
    if any(t.name == name for t in parsed):
        raise ToolError(f"{where}: a second tool named {name!r}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must be a JSON schema of type object")
    tool = Tool(
        name, parameters, str(function.get("description") or ""), bool(function.get("strict"))
    )
    try:  # checked now, so a bad schema is the caller's 400
        if isinstance(tool.arguments, Json):
            check_schema(load_schema(parameters))
    except ValueError as e:
        raise ToolError(f"{where}.function.parameters: {e}") from None
    return tool


@dataclass(frozen=True)
class ToolChoice:
    """`mode` is none, auto, required or function (then `name` is the function)."""

    mode: str
    name: str | None = None

    def tools(self, tools: list[Tool]) -> list[Tool]:
        """The tools a call may name under this choice."""
        return [t for t in tools if t.name == self.name] if self.mode == "function" else tools


def parse_tool_choice(choice: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's `tool_choice` (a mode string or `{"type": "function", "function": {"name"}}`);
    unset means auto with tools, none without."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolError(f"tool_choice {choice!r} needs tools")
        return ToolChoice(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if not any(t.name == name for t in tools):
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolChoice("function", name)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `arguments` is JSON text exactly as the model wrote it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    @classmethod
    def from_openai(cls, call: dict[str, Any]) -> ToolCall:
        """A call from a history message; arguments given as an object are written compactly."""
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        return cls(str(function.get("name", "")), arguments, str(call.get("id") or new_call_id()))


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: `name` once whole, `arguments` the text so far, `done` when
    the call is complete."""

    name: str | None
    arguments: str
    done: bool


@dataclass(frozen=True)
class Scan:
    """A reply read so far: `content` is the text before the calls (while streaming, less any
    tail that may yet become the trigger), `calls` the calls begun."""

    content: str
    calls: list[PartialCall]

    def finished_calls(self) -> list[ToolCall]:
        return [ToolCall(c.name, c.arguments) for c in self.calls if c.done and c.name]


class ToolCallParser:
    """One way of writing calls: its trigger (the text that starts the calls, and the section
    begins with it), the pattern of the calls section, how to read it back and how to write given
    calls into a prompt."""

    name: str
    trigger: str
    syntax: str  # how the default prompt tells the model to call

    def section(self, tools: list[Tool], parallel: bool) -> Pattern:
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def format_calls(self, calls: list[ToolCall]) -> str:
        raise NotImplementedError

    def constraint(
        self, tools: list[Tool], choice: ToolChoice, parallel: bool
    ) -> Constraint | None:
        """The constraint the reply decodes under (see the module docstring); None for `none`.
        Under `auto`, free text and the trigger that ends it are one stretch of the pattern (so
        one lexeme of a grammar)."""
        if choice.mode == "none":
            return None
        section = self.section(choice.tools(tools), parallel)
        if choice.mode == "auto":
            free = Re(avoiding(self.trigger))
            return render(alt(free, seq(Opt(free), section)))
        return render(section)

    def content_of(self, text: str, final: bool) -> str:
        """Text before the trigger; while streaming, less a tail that may begin the trigger."""
        at = text.find(self.trigger)
        if at >= 0:
            return text[:at]
        if final:
            return text
        for k in range(min(len(self.trigger) - 1, len(text)), 0, -1):
            if text.endswith(self.trigger[:k]):
                return text[:-k]
        return text


@dataclass(frozen=True)
class JsonCallFormat(ToolCallParser):
    """Calls written as `{"name": "...", "<args_key>": {...}}` objects (compact JSON, the name
    first), each wrapped in `call_open`/`call_close`, joined by `separator`, the whole section in
    `section_open`/`section_close`."""

    name: str
    trigger: str
    syntax: str
    section_open: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = ""
    section_close: str = ""
    args_key: str = "arguments"

    def section(self, tools: list[Tool], parallel: bool) -> Pattern:
        """The tools' names are alternatives after the common `{"name":"`, so that the trigger
        (which may end inside it) stays in the stretch before them."""
        names = alt(
            *(seq(Lit(f'{t.name}","{self.args_key}":'), t.arguments, Lit("}")) for t in tools)
        )
        call = seq(Lit(self.call_open + '{"name":"'), names, Lit(self.call_close))
        calls = seq(call, Star(seq(Lit(self.separator), call))) if parallel else call
        return seq(Lit(self.section_open), calls, Lit(self.section_close))

    def scan(self, text: str, final: bool) -> Scan:
        content = self.content_of(text, final)
        if len(content) == len(text) or not text.startswith(self.section_open, len(content)):
            return Scan(content, [])
        calls: list[PartialCall] = []
        pos = len(content) + len(self.section_open)
        while True:
            call, pos = self._scan_call(text, pos)
            if call is None:
                break
            calls.append(call)
            if not call.done or not text.startswith(self.separator, pos):
                break
            pos += len(self.separator)
        return Scan(content, calls)

    def _scan_call(self, text: str, pos: int) -> tuple[PartialCall | None, int]:
        head = f'{self.call_open}{{"name":"'
        if not text.startswith(head, pos):
            return None, pos
        start = pos + len(head)
        end = text.find('"', start)
        if end < 0:
            return PartialCall(None, "", False), len(text)
        name, pos = text[start:end], end + 1
        key = f',"{self.args_key}":'
        if not text.startswith(key, pos):
            return PartialCall(name, "", False), len(text)
        pos += len(key)
        args_end = json_value_end(text, pos)
        if args_end is None:
            return PartialCall(name, text[pos:], False), len(text)
        tail = "}" + self.call_close
        done = text.startswith(tail, args_end)
        return PartialCall(name, text[pos:args_end], done), args_end + len(tail)

    def format_calls(self, calls: list[ToolCall]) -> str:
        written = [
            f'{self.call_open}{{"name":{json.dumps(c.name)},'
            f'"{self.args_key}":{c.arguments}}}{self.call_close}'
            for c in calls
        ]
        return f"{self.section_open}{self.separator.join(written)}{self.section_close}"


@dataclass(frozen=True)
class PythonicFormat(ToolCallParser):
    """Calls written as a Python list of calls, `[get_weather(city="Paris"), ...]` (Llama 3.2/4);
    keyword values are JSON literals (Python's True/False/None read too). Streamed calls arrive
    whole, once the list closes."""

    name: str = "pythonic"
    trigger: str = "["
    syntax: str = (
        "To call functions, reply with only a Python list of calls:\n"
        '[func_name1(param1="value1", param2=2), func_name2(param=true)]'
    )

    def section(self, tools: list[Tool], parallel: bool) -> Pattern:
        one = alt(*(seq(Lit(f"{t.name}("), _kwargs(t), Lit(")")) for t in tools))
        calls = seq(one, Star(seq(Lit(", "), one))) if parallel else one
        return seq(Lit("["), calls, Lit("]"))

    def scan(self, text: str, final: bool) -> Scan:
        content = self.content_of(text, final)
        section = text[len(content) :]
        try:
            nodes = ast.parse(section, mode="eval").body if section.endswith("]") else None
        except SyntaxError:
            nodes = None
        if not isinstance(nodes, ast.List):
            return Scan(content, [])
        calls = []
        for node in nodes.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                return Scan(content, [])
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
            text_args = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
            calls.append(PartialCall(node.func.id, text_args, True))
        return Scan(content, calls)

    def format_calls(self, calls: list[ToolCall]) -> str:
        def call(c: ToolCall) -> str:
            kwargs = ", ".join(
                f"{k}={json.dumps(v, separators=(',', ':'), ensure_ascii=False)}"
                for k, v in json.loads(c.arguments).items()
            )
            return f"{c.name}({kwargs})"

        return "[" + ", ".join(call(c) for c in calls) + "]"


def _kwargs(tool: Tool) -> Pattern:
    """`key=value, ...`: required keywords first, then each optional one or not, in schema order."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    items = [
        (seq(Lit(f"{k}="), Json(v)), k in required)
        for k, v in sorted(props.items(), key=lambda kv: kv[0] not in required)
    ]
    musts = [p for p, req in items if req]
    optional = [p for p, req in items if not req]
    if musts:
        joined = [musts[0], *(seq(Lit(", "), p) for p in musts[1:])]
        return seq(*joined, *(Opt(seq(Lit(", "), p)) for p in optional))
    firsts = [
        seq(p, *(Opt(seq(Lit(", "), q)) for q in optional[i + 1 :])) for i, p in enumerate(optional)
    ]
    return Opt(alt(*firsts)) if firsts else Lit("")


def _literal(node: ast.expr | None) -> Any:
    """A keyword value: a Python literal, where the names true/false/null stand for JSON's.
    `node` is None for the `**` of a dict display, which is no literal."""
    if node is None:
        raise ValueError("a ** in a dict is not a literal")
    names = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def json_value_end(text: str, pos: int) -> int | None:
    """Index just past the JSON object or array that starts at `pos`; None while unfinished."""
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def avoiding(trigger: str) -> str:
    """A regex of the non-empty texts that never contain `trigger` (whose first character occurs
    only at its start): units that are a character other than that one, or runs of the trigger's
    proper prefixes broken off by a character that neither continues it nor starts it again; then
    possibly a run of prefixes. (Non-empty: the compiler's end anchor cannot follow an empty match.)"""
    first = trigger[0]
    if first in trigger[1:]:
        raise ValueError(f"trigger {trigger!r} repeats its first character")
    prefixes = "|".join(literal(trigger[:k]) for k in range(1, len(trigger)))
    broken = "|".join(
        literal(trigger[:k]) + f"[^{_class_char(trigger[k])}{_class_char(first)}]"
        for k in range(1, len(trigger))
    )
    if not prefixes:
        return f"[^{_class_char(first)}]+"
    unit = f"(?:[^{_class_char(first)}]|(?:{prefixes})*(?:{broken}))"
    return f"(?:{unit}+(?:{prefixes})*|(?:{prefixes})+)"


def _class_char(c: str) -> str:
    return "\\" + c if c in _CLASS_SPECIALS else c


HERMES = JsonCallFormat(
    name="hermes",
    trigger="<tool_call>",
    syntax=(
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    ),
    call_open="<tool_call>",
    call_close="</tool_call>",
    separator="\n",
)
LLAMA3_JSON = JsonCallFormat(
    name="llama3-json",
    trigger='{"name":',
    syntax=(
        "To call a function, respond with a JSON object of the form "
        '{"name": function name, "parameters": dictionary of argument name and its value}; '
        'separate several calls with "; ".'
    ),
    separator="; ",
    args_key="parameters",
)
MISTRAL = JsonCallFormat(
    name="mistral",
    trigger="[TOOL_CALLS]",
    syntax=(
        "To call functions, reply with [TOOL_CALLS] followed by a JSON list of calls: "
        '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    ),
    section_open="[TOOL_CALLS][",
    separator=",",
    section_close="]",
)
PARSERS: dict[str, ToolCallParser] = {
    p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL, PythonicFormat())
}
# what in a chat template tells which way its model writes calls; checked in order
_TEMPLATE_MARKS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("[func_name1(", "pythonic"),
    ('"parameters"', "llama3-json"),
)


def template_renders_tools(template: str | None) -> TypeGuard[str]:
    return template is not None and re.search(r"\btools\b", template) is not None


def resolve_parser(name: str, template: str | None) -> ToolCallParser:
    """`--tool-call-parser`: a named format, or `auto`: the one the chat template writes (when
    it renders tools), else Hermes."""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown tool call parser {name!r}; expected one of {PARSER_NAMES}")
    if name != "auto":
        return PARSERS[name]
    if template_renders_tools(template):
        for mark, parser in _TEMPLATE_MARKS:
            if mark in template:
                return PARSERS[parser]
    return HERMES


def tools_system_prompt(tools: list[Tool], parser: ToolCallParser) -> str:
    """The default tools block of the system message (Hermes style), for templates that do not
    render tools themselves."""
    signatures = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n{parser.syntax}"
    )


def prompt_messages(
    messages: list[dict[str, Any]], tools: list[Tool], parser: ToolCallParser, template: str | None
) -> list[dict[str, Any]]:
    """The messages to hand the chat template. One that renders tools gets them as they are
    (call arguments as objects, which templates expect). Otherwise the default: the tools block in
    the system message, assistant calls written in the parser's format (byte for byte what the
    model wrote, so the next turn's prefix is cached), tool results as user turns of
    `<tool_response>` blocks (consecutive ones in one turn)."""
    if template_renders_tools(template):
        return [_calls_as_objects(m) for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [ToolCall.from_openai(c) for c in m["tool_calls"]]
            out.append(
                {
                    "role": "assistant",
                    "content": (m.get("content") or "") + parser.format_calls(calls),
                }
            )
        elif m.get("role") == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools:
        block = tools_system_prompt(tools, parser)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _calls_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = []
    for i, c in enumerate(message["tool_calls"]):
        call = ToolCall.from_openai(c)
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError as e:
            raise ToolError(f"tool_calls[{i}].function.arguments is not JSON: {e}") from None
        function = {"name": call.name, "arguments": arguments}
        calls.append({"id": call.id, "type": "function", "function": function})
    return {**message, "tool_calls": calls}
