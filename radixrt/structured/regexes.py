"""Plain regexes for the constraint dtypes and JSON, importable without torch (the HTTP gateway
uses them to turn `response_format` into a constraint)."""

from __future__ import annotations

# compact, as json.dumps(separators=(",", ":")): short outputs, long forced runs
JSON_WHITESPACE = ""
DTYPE_REGEXES = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "bool": r"(true|false)",
    "str": r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"',
}
# Cheap up-front bounds on schema repetition counts (the automaton grows with them).


def json_object_regex() -> str:
    """`response_format: json_object`: a JSON object whose values are scalars, or arrays and
    objects of scalars. The constraint compiler refuses free-form JSON schemas, and one more level
    of nesting takes over its compile budget (10 s), so this grammar stops at depth two."""
    ws, string = JSON_WHITESPACE, DTYPE_REGEXES["str"]
    scalar = f"({string}|{DTYPE_REGEXES['float']}|true|false|null)"

    def array(value: str) -> str:
        return rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"

    def obj(value: str) -> str:
        member = f"{string}{ws}:{ws}{value}"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"

    return obj(f"({scalar}|{array(scalar)}|{obj(scalar)})")


JSON_OBJECT_REGEX = json_object_regex()
