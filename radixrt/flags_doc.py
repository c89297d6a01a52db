"""docs/flags.md, generated from the settings groups: every flag of `radixrt serve`, `radixrt
router` and `radixrt bench`, in the sections `--help` shows them in.

The page is never edited by hand: a setting added to a group of `ServerArgs` (or `RouterArgs`,
`BenchConfig`) changes it, and `tests/test_docs.py` fails until it is regenerated with
`python -m radixrt.flags_doc --write` (`make flags-doc`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from radixrt.config import RouterArgs, ServerArgs, Settings

PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
HEADER = """# Flags

Generated from `radixrt/config.py` (`ServerArgs`, `RouterArgs`) and `radixrt/bench/config.py`
(`BenchConfig`) by `python -m radixrt.flags_doc --write` (`make flags-doc`); do not edit by hand.
Every `radixrt serve` flag is also a keyword of `rt.Engine` / `rt.Runtime` (dashes become
underscores: `rt.Engine(max_total_tokens=4096)`). A boolean flag `--x` has its `--no-x`.
"""


def _default(value: Any) -> str:
    """A default as the table shows it."""
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Text that stays one table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _row(f: dataclasses.Field[Any], aliases: tuple[str, ...]) -> str:
    names = ", ".join(f"`{n}`" for n in ["--" + f.name.replace("_", "-"), *aliases])
    helptext = f.metadata["help"]
    choices = f.metadata.get("choices")
    if choices:
        helptext += f" (one of {', '.join(f'`{c}`' for c in choices)})"
    return f"| {names} | {_default(f.default)} | {_cell(helptext)} |"


def command_section(command: str, settings: type[Settings]) -> str:
    """One command's flags: a table per `--help` section, in `--help`'s order."""
    lines = [f"## `{command}`", ""]
    for title, members in settings.sections().items():
        lines += [f"### {title}", "", "| flag | default | meaning |", "|---|---|---|"]
        lines += [_row(f, settings.aliases.get(f.name, ())) for f in members] + [""]
    return "\n".join(lines)


def render() -> str:
    """The whole page."""
    from radixrt.bench.config import BenchConfig

    sections = [
        command_section("radixrt serve", ServerArgs),
        command_section("radixrt router", RouterArgs),
        command_section("radixrt bench", BenchConfig),
    ]
    return "\n".join([HEADER, *sections]).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE} instead of printing")
    if parser.parse_args().write:
        PAGE.write_text(render())
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
