"""The command line answers bad input in one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "argv, words",
    [
        (["serve", "--model", "/nonexistent"], "/nonexistent"),
        (["serve", "--page-size", "0"], "page_size"),
        (["serve", "--max-total-tokens", "-5"], "max_total_tokens"),
        (["prepare-model", "--model", "/nonexistent"], "/nonexistent"),
        (["serve", "--model", "nobody/absent"], "not in the local Hugging Face Hub cache"),
        (["serve", "--chat-template", "/nonexistent.jinja"], "neither a file nor a Jinja"),
        (["serve", "--tokenizer-path", "/nonexistent"], "/nonexistent"),
    ],
)
def test_bad_input_is_one_line(argv, words):
    proc = subprocess.run(
        [sys.executable, "-m", "radixrt", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"radixrt {argv[0]}: error:") and words in lines[0]
