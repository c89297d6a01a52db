"""SGLang's `structural_tag` constraint: free text in which each tagged segment (a tool call) is
held to its schema. It becomes llguidance's Lark grammar (its `StructTag`, the form SGLang's
llguidance backend builds): a structure's `begin` after one of the `triggers` it starts with,
then its JSON `schema`, then its `end`; text before, between and after is free.

Torch-free: the request's parameters are translated at the door (`SamplingParams.from_dict`).
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import StructTag


def structural_tag_lark(value: Any) -> str:
    """The Lark grammar of a structural tag (a JSON string or a map with `structures`, each
    `{begin, schema, end}`, and `triggers`); ValueError, naming what is wrong, otherwise."""
    tag = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object or its text")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag needs a non-empty `structures` list")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag needs `triggers`, a list of non-empty strings")
    return StructTag.to_grammar([_struct_tag(s, triggers) for s in structures])


def _struct_tag(structure: Any, triggers: list[str]) -> StructTag:
    """One structure, with the trigger its `begin` starts with (as SGLang pairs them)."""
    if not isinstance(structure, dict) or not all(
        isinstance(structure.get(k), str) for k in ("begin", "end")
    ):
        raise ValueError("each structural_tag structure needs string `begin` and `end`")
    schema = structure.get("schema")
    if not isinstance(schema, (dict, str)):
        raise ValueError("each structural_tag structure needs a JSON `schema`")
    trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
    if trigger is None:
        raise ValueError(f"no trigger begins structure {structure['begin']!r}")
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return StructTag(trigger=trigger, begin=structure["begin"], grammar=text, end=structure["end"])
