"""Structured-generation constraints with the default model's real tokenizer (no model weights)."""

from __future__ import annotations

import json
import random
import re
import time

import numpy as np
import pytest
import torch

from radixrt.kernels import cpu_mask
from radixrt.structured.bitmask import allocate_bitmask, apply_bitmask
from radixrt.structured.compiler import ConstraintCompiler
from radixrt.structured.vocabulary import build_vocabulary, token_bytes

from helpers import PADDED_VOCAB, allowed_ids

VOCAB = 49152


def random_walk(
    compiler: ConstraintCompiler,
    tokenizer,
    seed: int,
    max_steps: int = 300,
    jump: bool = False,
    **constraint,
) -> str:
    """Sample uniformly among the allowed tokens until the constraint is complete (stopping at a
    final state that allows more with probability 1/3), checking the mask against outlines-core.
    With `jump`, each sampled token is replaced by what jump-forward appends for it."""
    grammar = compiler.compile(**constraint)
    index, guide = grammar.index, grammar.guide(jump_forward=jump)
    rng = random.Random(seed)
    row = allocate_bitmask(1, PADDED_VOCAB)[0]
    ids: list[int] = []
    for _ in range(max_steps):
        guide.fill_mask(row)
        allowed = allowed_ids(row)
        assert allowed == sorted(index.get_allowed_tokens(guide.guide.get_state()))
        assert (compiler.eos_token_id in allowed) == guide.is_final()
        assert max(allowed) < VOCAB
        if guide.allowed_only_eos() or (guide.is_final() and rng.random() < 1 / 3):
            guide.advance(compiler.eos_token_id)
            assert guide.allowed_only_eos()
            return tokenizer.decode(ids)
        token = rng.choice([i for i in allowed if i != compiler.eos_token_id])
        for forced in guide.jump_forward(token):
            guide.advance(forced)
            ids.append(forced)
    raise AssertionError(f"no final state after {max_steps} tokens: {tokenizer.decode(ids)!r}")


def test_vocabulary_round_trip(tokenizer):
    mapping = token_bytes(tokenizer)
    vocabulary = build_vocabulary(tokenizer)
    assert build_vocabulary(tokenizer) is vocabulary
    assert vocabulary.get_eos_token_id() == tokenizer.eos_token_id
    assert not set(tokenizer.all_special_ids) & mapping.keys()
    texts = [
        "Hello, world!",
        "café 世界 🎉",
        "  two  spaces\n\ttab",
        '{"a": [1, 2.5e-3]}',
        "naïve résumé — ok",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(mapping[i] for i in ids) == text.encode()
        for i in ids:
            assert i in vocabulary.get(mapping[i])


def test_sentencepiece_tokens():
    class SentencePieceLike:
        name_or_path, eos_token_id, all_special_ids, added_tokens_decoder = (
            "fake-sp",
            2,
            [0, 1, 2],
            {},
        )

        def get_vocab(self):
            return {
                "<unk>": 0,
                "<s>": 1,
                "</s>": 2,
                "▁Hello": 3,
                "<0xE2>": 4,
                "<0x82>": 5,
                "<0xAC>": 6,
                "x▁y": 7,
            }

        def __len__(self):
            return 8

    assert token_bytes(SentencePieceLike()) == {
        3: b" Hello",
        4: b"\xe2",
        5: b"\x82",
        6: b"\xac",
        7: b"x y",
    }


REGEXES = [
    r"-?[0-9]{1,5}",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(Mr|Ms|Dr)\. [A-Z][a-z]{1,8}",
]


@pytest.mark.parametrize("jump", [False, True], ids=["token-by-token", "jump-forward"])
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walk(compiler, tokenizer, pattern, jump):
    for seed in range(3):
        text = random_walk(compiler, tokenizer, seed, jump=jump, regex=pattern)
        assert re.fullmatch(pattern, text), text


def test_choices_and_dtypes(compiler, tokenizer):
    choices = ["yes", "no", "maybe so", "café ☕", "a+b (c)"]
    for seed in range(4):
        assert random_walk(compiler, tokenizer, seed, choices=choices) in choices
        assert re.fullmatch(
            r"-?(0|[1-9][0-9]*)", random_walk(compiler, tokenizer, seed, dtype="int")
        )
        float(random_walk(compiler, tokenizer, seed, dtype="float"))
        assert random_walk(compiler, tokenizer, seed, dtype="bool") in ("true", "false")


ACCEPTED = [
    ({"dtype": "str"}, '"He said \\"hi\\" – café"'),
    ({"dtype": "float"}, "-12.5e+3"),
    ({"regex": r"(\[[0-9]\])+"}, "[1][2][3]"),
    ({"choices": ["yes", "yes, please"]}, "yes, please"),
    (
        {
            "json_schema": {
                "type": "object",
                "properties": {"v": {"type": "number"}},
                "required": ["v"],
            }
        },
        '{"v":0.25}',
    ),
]


@pytest.mark.parametrize("constraint,text", ACCEPTED)
def test_tokenizer_encoding_is_accepted(compiler, tokenizer, constraint, text):
    """The tokenizer's own encoding of a matching text reaches a final state. Most cases leave an
    accepting state for a non-accepting one ("12" -> "12."), which bare outlines-core drops."""
    guide = compiler.compile(**constraint).guide()
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert not guide.allowed_only_eos()
        guide.advance(token)
    assert guide.is_final()
    with pytest.raises(ValueError):
        guide.advance(tokenizer.encode("~", add_special_tokens=False)[0])


POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "integer"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
            "scores": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        },
        "required": ["tags", "scores"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "optional": {
        "type": "object",
        "required": ["id"],
        "properties": {"id": {"type": "integer"}, "note": {"type": "string", "maxLength": 8}},
    },
    "ref": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
}


def check(value, schema: dict, root: dict) -> None:
    """A small hand validator for the keywords used above."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(value) <= set(schema["properties"])
        assert set(schema.get("required", [])) <= set(value)
        for key, item in value.items():
            check(item, schema["properties"][key], root)
    elif kind == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get(
            "maxItems", 1e9
        )
        for item in value:
            check(item, schema["items"], root)
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1e9)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "boolean":
        assert isinstance(value, bool)


@pytest.mark.parametrize("jump", [False, True], ids=["token-by-token", "jump-forward"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_walk(compiler, tokenizer, name, jump):
    schema = SCHEMAS[name]
    for seed in range(3):
        text = random_walk(
            compiler, tokenizer, seed, jump=jump, json_schema=schema if seed else json.dumps(schema)
        )
        check(json.loads(text), schema, schema)
    assert compiler.compile(json_schema=schema) is compiler.compile(json_schema=schema)


def test_jump_forward_appends_forced_text_retokenized(compiler, tokenizer):
    guide = compiler.compile(json_schema=SCHEMAS["nested"]).guide(jump_forward=True)
    brace = tokenizer.encode("{", add_special_tokens=False)
    ids = guide.jump_forward(brace[0])
    text = tokenizer.decode(ids)
    assert len(ids) > 1 and text != "{" and '{"name":"'.startswith(text)
    assert ids == tokenizer.encode(text, add_special_tokens=False)  # the tokenizer's own split
    for token in ids:
        guide.advance(token)
    # Inside a string nothing is forced; a token that ends the string forces the next key.
    assert guide.jump_forward(
        tokenizer.encode("Bob", add_special_tokens=False)[0]
    ) == tokenizer.encode("Bob", add_special_tokens=False)
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert tokenizer.decode(guide.jump_forward(quote)).startswith('","address')
    # Choices sharing a prefix: only the common part is forced, and a final state forces nothing.
    choices = compiler.compile(choices=["Mount Everest", "Mount Fuji"]).guide(jump_forward=True)
    assert tokenizer.decode(
        choices.jump_forward(tokenizer.encode("M", add_special_tokens=False)[0])
    ) in ("Mount", "Mount ")
    plain = compiler.compile(choices=["Mount Everest", "Mount Fuji"]).guide()
    assert plain.jump_forward(brace[0]) == brace


def test_bad_constraints(compiler):
    with pytest.raises(ValueError, match="regex-automata"):
        compiler.compile(regex="(")
    with pytest.raises(ValueError, match="regex-automata"):
        compiler.compile(regex="(?=a)b")
    with pytest.raises(ValueError, match="not valid JSON"):
        compiler.compile(json_schema="{")
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        compiler.compile(json_schema={"type": "frobnicate"})
    with pytest.raises(ValueError, match="exactly one"):
        compiler.compile(regex="a", dtype="int")
    with pytest.raises(ValueError, match="unknown dtype"):
        compiler.compile(dtype="complex")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},
        {},
        {"type": "object", "properties": {"data": {"type": "array"}}},
        {"type": "object", "properties": {"bio": {"type": "string", "maxLength": 100000}}},
        {"type": "array", "items": {"type": "integer"}, "minItems": 5000},
    ],
)
def test_exploding_schema_rejected_up_front(compiler, schema):
    start = time.monotonic()
    with pytest.raises(ValueError, match="too"):
        compiler.compile(json_schema=schema)
    assert time.monotonic() - start < 0.5


def test_compile_budget(tokenizer):
    # A top-level bounded JSON string: its automaton grows exponentially with maxLength
    # (about 3 s for 15 on a slow core); its worker process is killed at the budget.
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB, compile_timeout_s=0.3)
    schema = {"type": "string", "maxLength": 15}
    try:
        for _ in range(2):  # the second time the cached verdict answers at once
            start = time.monotonic()
            with pytest.raises(ValueError, match="too complex"):
                compiler.compile(json_schema=schema)
            assert time.monotonic() - start < 2.0
        job = compiler.compile_async(regex=r"[0-9]{3}")
        assert compiler.compile(regex=r"[0-9]{3}") is job.result()
        assert compiler.compile_async(json_schema=schema).error is not None
    finally:
        compiler.close()
    assert compiler.stats().workers == 0


def unpack_reference(bitmask: torch.Tensor, width: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").astype(bool)
    return np.pad(bits, ((0, 0), (0, max(0, width - bits.shape[1]))))[:, :width]


def test_apply_bitmask(compiler):
    torch.manual_seed(0)
    bitmask = allocate_bitmask(4, PADDED_VOCAB)
    assert bitmask.shape == (4, (PADDED_VOCAB + 31) // 32) and bitmask.dtype == torch.int32
    compiler.compile(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}").guide().fill_mask(bitmask[0])
    bitmask[1] = torch.randint(-(2**31), 2**31 - 1, (bitmask.shape[1],), dtype=torch.int32)
    compiler.compile(choices=["yes", "no"]).guide().fill_mask(bitmask[2])
    bitmask[3] = -1
    logits = torch.randn(4, PADDED_VOCAB)
    original = logits.clone()
    apply_bitmask(logits, bitmask, rows=[0, 1, 2])

    allowed = unpack_reference(bitmask, PADDED_VOCAB)
    allowed[3] = True  # row 3 was not selected
    assert torch.equal(torch.isinf(logits), torch.from_numpy(~allowed))
    assert torch.equal(logits[torch.from_numpy(allowed)], original[torch.from_numpy(allowed)])
    assert torch.isinf(logits[0, VOCAB:]).all() and torch.isinf(logits[2, VOCAB:]).all()
    assert 1 <= (~torch.isinf(logits[2])).sum() < 20

    # All rows, with logits wider than the bitmask covers: the extra columns are masked.
    narrow = torch.tensor([[-1, 0b101], [0, -(2**31)]], dtype=torch.int32)
    logits = torch.zeros(2, 70)
    apply_bitmask(logits, narrow)
    allowed = unpack_reference(narrow, 70)
    assert torch.equal(torch.isinf(logits), torch.from_numpy(~allowed))
    assert allowed[0, :32].all() and allowed[0, [32, 34]].all() and allowed.sum() == 35


def test_the_c_mask_kernel_equals_the_torch_path():
    """The C pass (float32 CPU logits) against the torch op (taken for float64): chosen rows or
    all, logits narrower and wider than the bitmask covers, rows strided apart."""
    if cpu_mask._library() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    torch.manual_seed(1)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 40), dtype=torch.int32)
    bitmask[1], bitmask[2], bitmask[3, ::2] = 0, -1, 0
    for width in (1200, 1280, 1300):  # the bitmask covers 1280 columns
        for rows in (None, [0, 2, 4], [3]):
            logits = torch.randn(5, width + 7)[:, :width]
            reference = logits.double()
            assert cpu_mask.apply_bitmask(logits, bitmask, rows)
            apply_bitmask(reference, bitmask, rows)
            assert torch.equal(logits.double(), reference)
