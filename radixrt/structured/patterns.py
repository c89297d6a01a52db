"""A constraint built from literal text, regexes and JSON values, written once and rendered as one
regex (outlines-core) or as a Lark grammar (llguidance). Tool calls use it: their arguments are
JSON values under the tools' schemas, and a schema with keywords only llguidance enforces (numeric
bounds, `multipleOf`, ...) needs the grammar. No torch (the HTTP gateway and the DSL use it).

Rendering as Lark keeps every stretch without a JSON value as ONE terminal (a regex lexeme):
llguidance lexes greedily, so free text that may not contain a trigger, followed by a separate
lexeme that starts with that trigger, would lex wrongly (the free text runs on into the trigger's
prefix and dies at its last character); fused into one regex, the two are one DFA again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeAlias

from radixrt.structured.regexes import closed_objects, needs_grammar, schema_regex

# what Rust's regex syntax reads as more than itself (not `<` or `>`: escaped, they are word ends)
_META = set("\\.+*?()|[]{}^$#&-~")
# llguidance reads a JSON value under `%json` compact, as outlines-core's JSON_WHITESPACE
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def literal(text: str) -> str:
    """`text` as a regex that matches just it (Rust syntax)."""
    return "".join("\\" + c if c in _META else c for c in text)


@dataclass(frozen=True)
class Lit:
    """Exactly `text`."""

    text: str


@dataclass(frozen=True)
class Re:
    """A regex (Rust syntax) with no JSON value inside."""

    regex: str


@dataclass(frozen=True)
class Json:
    """A compact JSON value that validates against `schema` (a decoded, checked JSON schema)."""

    schema: dict[str, Any]


@dataclass(frozen=True)
class Seq:
    parts: tuple[Pattern, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Pattern, ...]


@dataclass(frozen=True)
class Opt:
    part: Pattern


@dataclass(frozen=True)
class Star:
    part: Pattern


Pattern: TypeAlias = Lit | Re | Json | Seq | Alt | Opt | Star


def seq(*parts: Pattern) -> Seq:
    return Seq(parts)


def alt(*options: Pattern) -> Alt:
    return Alt(options)


@dataclass(frozen=True)
class Constraint:
    """A rendered constraint: `kind` is "regex" or "lark", `value` its text; `params()` is what a
    request's sampling params carry."""

    kind: str
    value: str

    def params(self) -> dict[str, str]:
        return {self.kind: self.value}


def render(pattern: Pattern) -> Constraint:
    """`pattern` as a regex, unless a JSON value's schema needs a grammar: then as Lark."""
    if any(needs_grammar(j.schema) for j in _jsons(pattern)):
        return Constraint("lark", to_lark(pattern))
    return Constraint("regex", to_regex(pattern))


def to_regex(p: Pattern) -> str:
    """The regex of `p`; a JSON value becomes its schema's regex (outlines-core's translation)."""
    if isinstance(p, Lit):
        return literal(p.text)
    if isinstance(p, Re):
        return p.regex
    if isinstance(p, Json):
        return schema_regex(p.schema)
    if isinstance(p, Seq):
        return "".join(to_regex(q) for q in p.parts)
    if isinstance(p, Alt):
        return "(?:" + "|".join(to_regex(q) for q in p.options) + ")"
    return f"(?:{to_regex(p.part)})" + ("?" if isinstance(p, Opt) else "*")


def to_lark(pattern: Pattern) -> str:
    """A Lark grammar of `pattern`: each JSON value a `%json` rule (objects closed, as
    outlines-core reads them), every stretch without one a single regex terminal."""
    rules: list[str] = []

    def expr(p: Pattern) -> str:
        if not _jsons(p):
            regex = to_regex(p)
            return "/" + regex.replace("/", "\\/") + "/" if regex else '""'
        if isinstance(p, Json):
            rules.append(f"json{len(rules)}: %json {json.dumps(_compact(p.schema))}")
            return f"json{len(rules) - 1}"
        if isinstance(p, Seq):
            return " ".join(expr(q) for q in _runs(p))
        if isinstance(p, Alt):
            return "(" + " | ".join(expr(q) for q in p.options) + ")"
        assert isinstance(p, (Opt, Star))
        return f"({expr(p.part)})" + ("?" if isinstance(p, Opt) else "*")

    start = expr(pattern)
    return "\n".join([f"start: {start}", *rules])


def _runs(p: Seq) -> list[Pattern]:
    """`p`'s parts with nested sequences flattened and each run of parts without a JSON value
    joined into one sequence (one terminal in Lark)."""
    flat: list[Pattern] = []
    stack: list[Pattern] = list(reversed(p.parts))
    while stack:
        q = stack.pop()
        if isinstance(q, Seq) and _jsons(q):
            stack.extend(reversed(q.parts))
        else:
            flat.append(q)
    runs: list[Pattern] = []
    for q in flat:
        if isinstance(q, Lit) and not q.text:
            continue
        if runs and not _jsons(q) and not _jsons(runs[-1]):
            runs[-1] = seq(runs[-1], q)
        else:
            runs.append(q)
    return runs


def _jsons(p: Pattern) -> list[Json]:
    """The JSON values inside `p`."""
    if isinstance(p, Json):
        return [p]
    if isinstance(p, Seq):
        return [j for q in p.parts for j in _jsons(q)]
    if isinstance(p, Alt):
        return [j for q in p.options for j in _jsons(q)]
    if isinstance(p, (Opt, Star)):
        return _jsons(p.part)
    return []


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return {**closed_objects(schema), **_COMPACT}
