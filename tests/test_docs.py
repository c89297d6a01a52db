"""The docs that are generated or run: docs/flags.md is current, and the README's code blocks
marked `tested` (a fence's info string: ```` ```bash tested ````) work as written against a live
server."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from radixrt.cli import build_parser
from radixrt.config import ServerArgs
from radixrt.flags_doc import PAGE, render
from radixrt.protocol_doc import PAGE as PROTOCOL_PAGE
from radixrt.protocol_doc import render as render_protocol

from timeouts import REPLY_TIMEOUT_S

README = Path(__file__).resolve().parents[1] / "README.md"
FIRST_SCREEN_LINES = 150  # the README before its links
README_ADDRESS = "127.0.0.1:30000"  # where the README's commands find the server


@dataclass(frozen=True)
class CodeBlock:
    language: str
    code: str


def readme_blocks() -> list[CodeBlock]:
    """The README's fenced blocks whose info string ends in `tested`, in order."""
    fences = re.findall(r"^```(\w+) tested\n(.*?)^```$", README.read_text(), re.M | re.S)
    return [CodeBlock(language, code) for language, code in fences]


def test_flags_page_is_current():
    """docs/flags.md is what the settings generate; a new or changed flag fails this until the
    page is regenerated (`make flags-doc`)."""
    assert PAGE.read_text() == render(), "docs/flags.md is stale: run `make flags-doc`"


def test_request_field_table_is_current():
    """docs/protocol.md's request-field table is what `GenerateOptions` generates; a new or
    changed request field fails this until it is regenerated (`make protocol-doc`)."""
    page = PROTOCOL_PAGE.read_text()
    assert page == render_protocol(page), "docs/protocol.md is stale: run `make protocol-doc`"


def test_readme_first_screen_is_short_and_serves_a_model():
    """At most FIRST_SCREEN_LINES before the links; the tested blocks are the serve command, a
    curl, an `openai` call and a DSL program, in that order; the serve command parses to a
    server on the address the others use."""
    text = README.read_text()
    assert text.index("\n## Links") < len("\n".join(text.splitlines()[:FIRST_SCREEN_LINES]))
    blocks = readme_blocks()
    assert [b.language for b in blocks] == ["bash", "bash", "python", "python"]
    assert blocks[1].code.startswith("curl") and "from openai import" in blocks[2].code
    assert "@rt.function" in blocks[3].code
    argv = shlex.split(blocks[0].code)
    assert argv[:2] == ["radixrt", "serve"]
    args = ServerArgs.from_cli_args(build_parser().parse_args(argv[1:]))
    assert f"{args.host}:{args.port}" == README_ADDRESS and args.model == "default"


def test_readme_blocks_run_against_a_live_server(default_runtime):
    """The session's default-model runtime stands in for `radixrt serve --model default`: each
    client block runs as written, with the runtime's address for the README's and its served
    name for "default" (it was started from the model's folder)."""
    address = default_runtime.http_url.removeprefix("http://")
    served = default_runtime.model_info["model"]
    outputs = []
    for block in readme_blocks()[1:]:
        code = block.code.replace(README_ADDRESS, address)
        code = code.replace('"model": "default"', f'"model": "{served}"')
        code = code.replace('model="default"', f"model={served!r}")
        command = ["bash", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(command, capture_output=True, text=True, timeout=REPLY_TIMEOUT_S)
        assert done.returncode == 0, f"{block.code}\n{done.stderr[-2000:]}"
        outputs.append(done.stdout)
    curl, client, program = outputs
    assert json.loads(curl)["choices"][0]["message"]["content"]
    assert "cached prompt tokens:" in client
    answer, verdict = program.splitlines()[0].rsplit(" | ", 1)
    assert answer.strip() and verdict in ("yes", "no")
