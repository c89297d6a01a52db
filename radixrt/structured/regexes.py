"""Plain regexes for the constraint dtypes, the grammar of any JSON object, and JSON schemas checked and turned into
regexes; importable without torch (the HTTP gateway uses them for `response_format` and tools)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from radixrt.protocol import nesting_depth
from radixrt.structured.compile_worker import schema_regex as translate

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
# The budget on a JSON schema's expansion: outlines-core writes every `$ref` out in full (a
# recursive one RECURSION_DEPTH times deep), so three levels of 64 properties, each a `$ref` to
# the level below, make a 6.5 MB regex from a 6 KB schema. `check_expansion` walks the schema as
# the translation would, adding up a lower bound of the regex's length, and stops the moment it
# passes MAX_REGEX_CHARS (or a quarter as many nodes): no translation starts past the budget.
RECURSION_DEPTH = 3  # how many times deep outlines-core expands a `$ref` inside itself
# the length of outlines-core's regex for each type, at least (a string's `pattern` replaces it)
_TYPE_CHARS = {"integer": 19, "number": 49, "boolean": 12, "null": 4, "object": 2, "array": 2}
_STRING_CHARS = 43
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
    if nesting_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError) as e:  # a map with non-string keys or non-JSON values
        raise ValueError(f"json_schema is not JSON: {e}") from None
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(f"json_schema has {size} chars as JSON; at most {MAX_SCHEMA_CHARS}")
    return value


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
    a schema that is malformed, too large or too complex to constrain (see `load_schema`,
    `check_schema` and `check_expansion`: the translation starts only within the budget)."""
    schema = load_schema(schema)
    check_schema(schema)
    check_expansion(schema)
    return translate(json.dumps(schema), whitespace, MAX_REGEX_CHARS)


@dataclass(frozen=True)
class _Expansion:
    """A schema node as the translation reaches it: how many times its regex is written out
    (`copies`: optional properties and array items repeat) and the `$ref`s followed to reach it."""

    node: Any
    copies: int
    refs: tuple[str, ...]


def check_expansion(schema: dict[str, Any], budget: int = MAX_REGEX_CHARS) -> int:
    """A lower bound of the length of outlines-core's regex for (loaded, checked) `schema`, its
    `$ref`s expanded as the translation expands them; ValueError as soon as the
    running total passes `budget` chars (MAX_REGEX_CHARS: what a regex may take) or the walk
    `budget` / 4 nodes, so the cost of the check is bounded by the budget however far the schema
    would expand. Nothing here recurses."""
    total, nodes = 0, 0
    stack = [_Expansion(schema, 1, ())]
    while stack:
        at = stack.pop()
        nodes += 1
        if isinstance(at.node, dict):
            total += _own_chars(at.node) * at.copies
            stack.extend(_inside(schema, at))
        if total > budget or nodes > budget // 4:
            raise ValueError(
                f"json_schema is too large once its $refs are expanded: its regex would take over "
                f"{budget} chars or {budget // 4} schema nodes (the expansion budget); share "
                "less through $ref or split the schema"
            )
    return total


def _own_chars(node: dict[str, Any]) -> int:
    """The regex chars schema `node` writes itself (its subschemas counted apart), at least."""
    chars = 0
    if "enum" in node and isinstance(node["enum"], list):
        chars += sum(len(json.dumps(v)) for v in node["enum"])
    elif "const" in node:
        chars += len(json.dumps(node["const"]))
    else:
        kinds = node.get("type")
        for kind in kinds if isinstance(kinds, list) else [kinds]:
            if kind == "string":
                chars += len(node.get("pattern", "")) + 2 if "pattern" in node else _STRING_CHARS
            else:
                chars += _TYPE_CHARS.get(kind, 0) if isinstance(kind, str) else 0
    properties = node.get("properties")
    if isinstance(properties, dict):
        chars += sum(len(json.dumps(name)) + 1 for name in properties)
    return chars


def _inside(root: dict[str, Any], at: _Expansion) -> Iterator[_Expansion]:
    """The nodes the translation of `at` expands next: its subschemas (not its `$defs`), each as
    many times as outlines-core writes it, and the target of its `$ref` unless that `$ref` is
    already RECURSION_DEPTH deep on the way here (outlines-core stops there). outlines-core writes
    an array's `items` twice (the first and the rest) and, when no property is required, the i-th
    of k properties k - i times (each may be the first present)."""
    node = at.node
    properties = node.get("properties")
    if isinstance(properties, dict):
        k, optional = len(properties), not node.get("required")
        for i, sub in enumerate(properties.values()):
            yield _Expansion(sub, at.copies * (k - i if optional else 1), at.refs)
    for where, sub in subschemas(node):
        if not where.startswith((".properties.", ".$defs.", ".definitions.")):
            yield _Expansion(sub, at.copies * (2 if where == ".items" else 1), at.refs)
    ref = node.get("$ref")
    if isinstance(ref, str) and at.refs.count(ref) < RECURSION_DEPTH:
        target = _resolve(root, ref)
        if target is not None:
            yield _Expansion(target, at.copies, (*at.refs, ref))


def _resolve(root: dict[str, Any], ref: str) -> Any:
    """The node a local `$ref` ("#" or a JSON pointer "#/a/b") names in `root`; None for another
    kind of `$ref` or a pointer to nothing (the translation reports those)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


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
