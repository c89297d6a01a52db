"""The structured-generation tests' tokenizer and constraint compiler (the default model's real
tokenizer, no model weights), one of each per module."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from radixrt.structured.compiler import ConstraintCompiler

from helpers import PADDED_VOCAB


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB)
    yield compiler
    compiler.close()
