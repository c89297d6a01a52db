"""docs/protocol.md's table of request fields, generated from `protocol.GenerateOptions`.

The table is never edited by hand: a field added to `GenerateOptions` changes it, and
`tests/test_docs.py` fails until it is regenerated with `python -m radixrt.protocol_doc --write`
(`make protocol-doc`). Only the lines between `BEGIN` and `END` are written; the prose around
them is the page's own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, get_args, get_type_hints

from radixrt.protocol import GenerateOptions, option_fields, spec_of

PAGE = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
BEGIN = (
    "<!-- request fields: generated from radixrt/protocol.py by "
    "`python -m radixrt.protocol_doc --write`; do not edit -->"
)
END = "<!-- end of the request fields -->"
TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _type(hint: Any) -> str:
    """A field's type as the table names it (its None, "not sent", left out)."""
    kinds = [a for a in get_args(hint) if a is not type(None)] or [hint]
    return " or ".join(TYPE_NAMES.get(k, getattr(k, "__name__", str(k))) for k in kinds)


def _carried_by(options: type[GenerateOptions], name: str) -> str:
    spec = spec_of(next(f for f in option_fields(options) if f.name == name))
    where = ["`generate`"] + (["`pin`"] if spec.namespace else [])
    where += ["OpenAI bodies"] if spec.openai else []
    native = "native `/generate`" + (" (or a list, one per prompt)" if spec.per_prompt else "")
    return ", ".join([*where, native])


def field_table(options: type[GenerateOptions] = GenerateOptions) -> str:
    """The table of `options`' request fields: name, type, an example, where each is carried,
    what it means."""
    hints = get_type_hints(options)
    lines = ["| field | type | example | carried by | meaning |", "|---|---|---|---|---|"]
    for f in option_fields(options):
        spec = spec_of(f)
        doc = spec.doc.replace("|", "\\|").replace("\n", " ")
        cells = [f"`{f.name}`", _type(hints[f.name]), f"`{json.dumps(spec.example)}`"]
        cells += [_carried_by(options, f.name), doc]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def render(page: str, options: type[GenerateOptions] = GenerateOptions) -> str:
    """`page` with the lines between its markers replaced by the current table."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{field_table(options)}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE} instead of printing")
    if parser.parse_args().write:
        PAGE.write_text(render(PAGE.read_text()))
    else:
        print(field_table())


if __name__ == "__main__":
    main()
