"""Plain regexes for the constraint dtypes and JSON, and JSON schemas checked and turned into
regexes; importable without torch (the HTTP gateway uses them for `response_format` and tools)."""

from __future__ import annotations

import json
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

# compact, as json.dumps(separators=(",", ":")): short outputs, long forced runs
JSON_WHITESPACE = ""
DTYPE_REGEXES = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "bool": r"(true|false)",
    "str": r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"',
}


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

# Cheap up-front bounds on schema repetition counts (the automaton grows with them).
MAX_SCHEMA_LENGTH = 256
MAX_SCHEMA_ITEMS = 64
_SCHEMA_KEYWORDS = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")


def check_schema(node: Any, path: str = "$") -> None:
    """Reject up front, cheaply, schema shapes whose DFA is known to explode; the compile-time
    budget catches the rest (e.g. a top-level string with maxLength 20 already takes minutes)."""
    if not isinstance(node, dict):
        return
    if not any(k in node for k in _SCHEMA_KEYWORDS):
        raise ValueError(
            f"JSON schema at {path} accepts any JSON value, which is too complex to constrain; "
            "give it a type"
        )
    types = node["type"] if isinstance(node.get("type"), list) else [node.get("type")]
    if (
        "object" in types
        and not node.get("properties")
        and not isinstance(node.get("additionalProperties"), dict)
    ):
        raise ValueError(
            f"JSON schema at {path} is a free-form object, which is too complex to constrain; "
            "list its properties"
        )
    if "array" in types and "items" not in node and "prefixItems" not in node:
        raise ValueError(
            f"JSON schema at {path} is an array of any values, which is too complex to constrain; "
            "give its items"
        )
    for bound, limit in (
        ("minLength", MAX_SCHEMA_LENGTH),
        ("maxLength", MAX_SCHEMA_LENGTH),
        ("minItems", MAX_SCHEMA_ITEMS),
        ("maxItems", MAX_SCHEMA_ITEMS),
    ):
        if isinstance(node.get(bound), int) and node[bound] > limit:
            raise ValueError(
                f"JSON schema at {path}: {bound}={node[bound]} is too large to constrain "
                f"(at most {limit}); the automaton grows with it"
            )
    for key in ("properties", "$defs", "definitions"):
        for name, sub in (node.get(key) or {}).items():
            check_schema(sub, f"{path}.{key}.{name}")
    for key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not"):
        subs = node.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else [subs]):
            check_schema(sub, f"{path}.{key}[{i}]" if isinstance(subs, list) else f"{path}.{key}")


def schema_regex(schema: dict[str, Any], whitespace: str = JSON_WHITESPACE) -> str:
    """The regex of the JSON texts `schema` accepts; ValueError for a schema that is malformed or
    too complex to constrain (see `check_schema`)."""
    check_schema(schema)
    try:
        return build_regex_from_schema(json.dumps(schema), whitespace)
    except (ValueError, TypeError) as e:
        raise ValueError(f"unsupported JSON schema: {e}") from None
