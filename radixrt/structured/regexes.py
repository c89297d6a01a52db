"""Plain regexes for the constraint dtypes, the grammar of any JSON object, and JSON schemas checked and turned into
regexes; importable without torch (the HTTP gateway uses them for `response_format` and tools)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
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


# `response_format: json_object`: any JSON object, nested to any depth, compact as the schemas'
# JSON; a grammar (regexes cannot nest), so it always compiles with llguidance
JSON_OBJECT_LARK = 'start: %json {"type": "object", "x-guidance": {"whitespace_flexible": false}}'

# Cheap up-front bounds on schema repetition counts (the automaton grows with them).
MAX_SCHEMA_LENGTH = 256
MAX_SCHEMA_ITEMS = 64
# Bounds on a constraint's own size, checked before anything parses or recurses into it: the
# schema-to-regex translation and the regex parser recurse once per level (deep enough, a stack
# overflow kills the process), and the text sizes bound the work of every later step.
MAX_SCHEMA_DEPTH = 64  # nested JSON containers (maps and lists) in a schema
MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text
MAX_REGEX_CHARS = 64 * 1024  # a regex, as given or as a translation (tool calls make long ones)
_SCHEMA_KEYWORDS = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_SUBSCHEMAS = ("additionalProperties", "not")
_SCHEMA_STRINGS = ("$ref", "pattern", "format", "title", "description")
_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties")
# Keywords outlines-core's regexes ignore and llguidance enforces: a schema with one compiles with
# llguidance whatever `--grammar-backend` says, so that its outputs validate.
GRAMMAR_KEYWORDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "patternProperties",
    "minProperties",
    "maxProperties",
)
# Keywords no backend enforces while decoding: a schema with one is refused, naming it, since its
# outputs could break it (llguidance also reports any other key it does not implement).
UNENFORCED_KEYWORDS = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def load_schema(value: Any) -> dict[str, Any]:
    """A JSON schema given as JSON text or as an already decoded map, checked for size and
    nesting before it is parsed or walked (iteratively: nothing here recurses). ValueError names
    what is wrong."""
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"json_schema has {len(value)} chars; at most {MAX_SCHEMA_CHARS}")
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON object, not {_kind(value)}")
    if nesting_depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError) as e:  # a map with non-string keys or non-JSON values
        raise ValueError(f"json_schema is not JSON: {e}") from None
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(f"json_schema has {size} chars as JSON; at most {MAX_SCHEMA_CHARS}")
    return value


def nesting_depth(value: Any) -> int:
    """How many maps and lists deep `value` nests (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:  # past the bound the answer is known; stop descending
                stack.extend((child, depth + 1) for child in _children(node))
    return deepest


def _children(node: dict[Any, Any] | list[Any]) -> Iterable[Any]:
    return node.values() if isinstance(node, dict) else node


def _kind(value: Any) -> str:
    """A JSON value's kind, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def check_schema(node: Any, path: str = "$") -> None:
    """Reject up front, cheaply, schemas of the wrong shape (a keyword whose value has the wrong
    type) and shapes whose DFA is known to explode; the compile-time budget catches the rest
    (e.g. a top-level string with maxLength 20 already takes minutes). The caller bounds the
    nesting (`load_schema`), so the recursion here is bounded too."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError(f"JSON schema at {path} must be an object or a boolean, not {_kind(node)}")
    _check_keyword_types(node, path)
    check_enforced(node, path)
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
        if node.get(bound, 0) > limit:
            raise ValueError(
                f"JSON schema at {path}: {bound}={node[bound]} is too large to constrain "
                f"(at most {limit}); the automaton grows with it"
            )
    for where, sub in subschemas(node):
        check_schema(sub, f"{path}{where}")


def check_enforced(node: dict[str, Any], path: str = "$") -> None:
    """ValueError naming the first keyword of UNENFORCED_KEYWORDS in schema `node` (this node only)."""
    for key in UNENFORCED_KEYWORDS:
        if key in node:
            raise ValueError(
                f"JSON schema at {path}: {key!r} cannot be enforced while decoding, so outputs "
                "could break it; drop it or say it with enum, pattern or bounds"
            )


def needs_grammar(schema: Any) -> bool:
    """Whether a (loaded) schema uses a keyword of GRAMMAR_KEYWORDS anywhere."""
    return any(k in node for _, node in schema_nodes(schema) for k in GRAMMAR_KEYWORDS)


def schema_nodes(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in `schema` (itself included) with where it lies, walked without
    recursion; a node may be changed in place before the walk moves past it."""
    stack: list[tuple[str, Any]] = [("$", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            yield path, node
            stack.extend((path + where, sub) for where, sub in subschemas(node))


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which an object schema that lists properties and says nothing of
    `additionalProperties` says false: outlines-core reads schemas so (as xgrammar's strict
    mode does), and a schema must mean the same under either backend, though JSON Schema itself
    would allow other keys. Walked without recursion (`load_schema` bounded the depth)."""
    root = copy.deepcopy(schema)
    for _, node in schema_nodes(root):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return root


def subschemas(node: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """Each schema directly inside schema `node`, with where it lies (".properties.name",
    ".anyOf[0]", ...): the values of its maps of schemas, its lists of schemas and its single
    subschemas (`items` either). A map of the wrong type has none (`check_schema` names it)."""
    for key in _SCHEMA_MAPS:
        subs = node.get(key)
        if isinstance(subs, dict):
            yield from ((f".{key}.{name}", sub) for name, sub in subs.items())
    for key in ("items", *_SCHEMA_LISTS, *_SCHEMA_SUBSCHEMAS):
        subs = node.get(key)
        if isinstance(subs, list):
            yield from ((f".{key}[{i}]", sub) for i, sub in enumerate(subs))
        elif subs is not None:
            yield f".{key}", subs


def _check_keyword_types(node: dict[str, Any], path: str) -> None:
    """Each keyword radixrt or outlines-core reads has a value of the type the JSON Schema spec
    gives it; ValueError names the first that does not."""

    def wrong(key: str, expected: str) -> ValueError:
        return ValueError(
            f"JSON schema at {path}: {key!r} must be {expected}, not {_kind(node[key])}"
        )

    for key in _SCHEMA_MAPS:
        if key in node and not isinstance(node[key], dict):
            raise wrong(key, "an object of schemas")
    for key in _SCHEMA_LISTS:
        if key in node and (not isinstance(node[key], list) or not node[key]):
            raise wrong(key, "a non-empty array of schemas")
    for key in _SCHEMA_SUBSCHEMAS:
        if key in node and not isinstance(node[key], (dict, bool)):
            raise wrong(key, "a schema (an object or a boolean)")
    if "items" in node and not isinstance(node["items"], (dict, bool, list)):
        raise wrong("items", "a schema or an array of schemas")
    for key in _SCHEMA_STRINGS:
        if key in node and not isinstance(node[key], str):
            raise wrong(key, "a string")
    for key in _SCHEMA_COUNTS:
        value = node.get(key)
        if key in node and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise wrong(key, "a non-negative integer")
    kinds = node.get("type")
    if "type" in node and not (
        isinstance(kinds, str) or isinstance(kinds, list) and all(isinstance(t, str) for t in kinds)
    ):
        raise wrong("type", "a string or an array of strings")
    required = node.get("required")
    if "required" in node and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise wrong("required", "an array of strings")
    if "enum" in node and not isinstance(node["enum"], list):
        raise wrong("enum", "an array")


def schema_regex(schema: Any, whitespace: str = JSON_WHITESPACE) -> str:
    """The regex of the JSON texts `schema` (JSON text or a decoded map) accepts; ValueError for
    a schema that is malformed, too large or too complex to constrain (see `load_schema` and
    `check_schema`)."""
    schema = load_schema(schema)
    check_schema(schema)
    try:
        regex: str = build_regex_from_schema(json.dumps(schema), whitespace)
    except Exception as e:  # noqa: BLE001 (outlines-core raises several types for bad schemas)
        raise ValueError(f"unsupported JSON schema: {e}") from None
    check_regex(regex, "json_schema's regex")
    return regex


def check_regex(regex: Any, what: str = "regex") -> None:
    """A regex constraint is a string of at most MAX_REGEX_CHARS chars that UTF-8 can carry."""
    if not isinstance(regex, str):
        raise ValueError(f"{what} must be a string, not {_kind(regex)}")
    if len(regex) > MAX_REGEX_CHARS:
        raise ValueError(f"{what} has {len(regex)} chars; at most {MAX_REGEX_CHARS}")
    try:
        regex.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e}") from None
