"""Context-free grammars (GBNF and Lark) and the llguidance backend, walked token by token over
the default model's real tokenizer (no model weights); one tiny-model run at the end."""

from __future__ import annotations

import ast
import json
import random
import re

import pytest

from radixrt.bench.suites.grammar import ARITHMETIC_GBNF
from radixrt.protocol import ErrorCode
from radixrt.sampling_params import SamplingParams
from radixrt.structured.bitmask import allocate_bitmask
from radixrt.structured.compiler import ConstraintCompiler, ConstraintError
from radixrt.structured.regexes import JSON_OBJECT_LARK, closed_objects
from radixrt.structured.tools import PARSERS, ToolCall, ToolChoice, parse_tools

from helpers import (
    PADDED_VOCAB,
    RECORD_SCHEMA,
    allowed_ids,
    drain,
    make_scheduler,
    run_in_process,
)
from ownership import assert_no_leak

PAIRS_LARK = r"""
start: "{" pair ("," pair)* "}"
pair: KEY "=" VALUE
KEY: /[a-z]+/
VALUE: /[0-9]+/
"""
PAIRS = re.compile(r"\{[a-z]+=[0-9]+(,[a-z]+=[0-9]+)*\}")


def walk_text(compiler, tokenizer, text: str, **constraint) -> None:
    """Feed `text`'s tokens one by one: each is in the mask before it is consumed, EOS is in the
    mask exactly when the output is final, and it is final only at the end."""
    guide = compiler.compile(**constraint).guide()
    row = allocate_bitmask(1, PADDED_VOCAB)[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token in ids:
        guide.fill_mask(row)
        allowed = allowed_ids(row)
        assert token in allowed
        assert (compiler.eos_token_id in allowed) == guide.is_final()
        guide.advance(token)
    assert guide.is_final() and guide.allowed_prefix([compiler.eos_token_id]) == 1
    guide.advance(compiler.eos_token_id)
    assert guide.allowed_only_eos()


def random_walks(compiler, tokenizer, seeds: int, max_steps: int = 60, **constraint) -> list[str]:
    """Sample among the masked-in tokens (EOS, when allowed, half of the time; else half of the
    time a token not starting with a letter or digit, so walks reach their closing brackets);
    the texts of the walks that ended within `max_steps`. Every sampled token must advance."""
    grammar = compiler.compile(**constraint)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    structural = {i for i, piece in enumerate(pieces) if not piece[:1].isalnum()}
    row = allocate_bitmask(1, PADDED_VOCAB)[0]
    texts = []
    for seed in range(seeds):
        rng, guide, ids = random.Random(seed), grammar.guide(), []
        for _ in range(max_steps):
            guide.fill_mask(row)
            allowed = set(allowed_ids(row))
            assert allowed and all(t < len(tokenizer) for t in allowed)
            if compiler.eos_token_id in allowed and (len(allowed) == 1 or rng.random() < 0.5):
                texts.append(tokenizer.decode(ids))
                break
            allowed.discard(compiler.eos_token_id)
            marks = sorted(allowed & structural)
            token = rng.choice(marks if marks and rng.random() < 0.5 else sorted(allowed))
            guide.advance(token)
            ids.append(token)
    return texts


def test_gbnf_arithmetic_mask_walk(compiler, tokenizer):
    for text in ("12+3", "(1+2)*34-5", "((7))/0"):
        walk_text(compiler, tokenizer, text, ebnf=ARITHMETIC_GBNF)
    guide = compiler.compile(ebnf=ARITHMETIC_GBNF).guide()
    row = allocate_bitmask(1, PADDED_VOCAB)[0]
    guide.fill_mask(row)
    for bad in ("+", ")", "a", " "):
        assert tokenizer.encode(bad, add_special_tokens=False)[0] not in allowed_ids(row)
    with pytest.raises(ValueError):
        guide.advance(tokenizer.encode("+", add_special_tokens=False)[0])
    texts = random_walks(compiler, tokenizer, 12, ebnf=ARITHMETIC_GBNF)
    assert texts
    for text in texts:  # an arithmetic expression is a Python one, once leading zeros go
        ast.parse(re.sub(r"\b0+(\d)", r"\1", text), mode="eval")


def test_lark_mask_walk(compiler, tokenizer):
    walk_text(compiler, tokenizer, "{a=1,bc=23}", lark=PAIRS_LARK)
    texts = random_walks(compiler, tokenizer, 12, lark=PAIRS_LARK)
    assert texts and all(PAIRS.fullmatch(t) for t in texts)


def test_structural_tag_holds_only_the_tagged_segment(compiler, tokenizer):
    """SGLang's structural_tag, as the sampling params translate it: free text around, the
    trigger starts its structure, whose JSON and end are then enforced."""
    tag = {
        "structures": [
            {"begin": "<f=now>", "schema": {"type": "integer"}, "end": "</f>"},
            {"begin": "<f=say>", "schema": {"type": "string"}, "end": "</f>"},
        ],
        "triggers": ["<f="],
    }
    lark = SamplingParams.from_dict({"structural_tag": json.dumps(tag)}).lark
    for text in ("no tags", 'a <f=now>12</f> b <f=say>"hi"</f>', "<f=now>-3</f>"):
        walk_text(compiler, tokenizer, text, lark=lark)
    guide = compiler.compile(lark=lark).guide()
    for token in tokenizer.encode("x <f=now>", add_special_tokens=False):
        guide.advance(token)
    with pytest.raises(ValueError):  # the integer the structure holds, not text
        guide.advance(tokenizer.encode("abc", add_special_tokens=False)[0])


def test_bad_grammars_fail_by_name(compiler):
    for constraint in (
        {"ebnf": "root ::= ("},
        {"ebnf": "root ::= undefined"},
        {"lark": "start: foo bar ::="},
        {"lark": 42},
    ):
        with pytest.raises(ConstraintError):
            compiler.compile(**constraint)
    with pytest.raises(ConstraintError, match="exactly one"):
        compiler.compile(ebnf=ARITHMETIC_GBNF, lark=PAIRS_LARK)


def test_json_object_at_any_depth(compiler, tokenizer):
    """`response_format: json_object`'s grammar compiles with llguidance whatever the backend."""
    assert compiler.backend == "outlines"
    assert compiler.compile(lark=JSON_OBJECT_LARK).backend == "llguidance"
    deep = {"a": [{"b": {"c": {"d": [1.5, {"e": None, "f": "x"}]}}}], "g": True}
    walk_text(compiler, tokenizer, json.dumps(deep, separators=(",", ":")), lark=JSON_OBJECT_LARK)
    texts = random_walks(compiler, tokenizer, 8, max_steps=80, lark=JSON_OBJECT_LARK)
    assert all(isinstance(json.loads(t), dict) for t in texts)
    guide = compiler.compile(lark=JSON_OBJECT_LARK).guide()
    assert guide.allowed_prefix(tokenizer.encode("[1]", add_special_tokens=False)) == 0


def test_llguidance_backend_json_and_jump_forward(tokenizer):
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB, backend="llguidance")
    try:
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "age"],
        }
        grammar = compiler.compile(json_schema=schema)
        assert grammar.backend == "llguidance" and compiler.compile(json_schema=schema) is grammar
        walk_text(compiler, tokenizer, '{"name":"Bob","age":7}', json_schema=schema)
        brace = tokenizer.encode("{", add_special_tokens=False)[0]
        jumped = grammar.guide(jump_forward=True).jump_forward(brace)
        assert tokenizer.decode(jumped).startswith('{"name')
        assert grammar.guide().jump_forward(brace) == [brace]
        draft = tokenizer.encode('{"name":"Al"x', add_special_tokens=False)
        assert grammar.guide().allowed_prefix(draft) == len(draft) - 1
        walk_text(compiler, tokenizer, "2024-01-31", regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
        walk_text(compiler, tokenizer, "no", choices=["yes", "no"])
    finally:
        compiler.close()


def _check_arithmetic(tokenizer, ids: list[int], eos: int) -> None:
    """Output under ARITHMETIC_GBNF: a whole expression once finished (leading zeros aside,
    which Python refuses), else a prefix of one."""
    text = tokenizer.decode([t for t in ids if t != eos])
    if ids and ids[-1] == eos:
        ast.parse(re.sub(r"\b0+(\d)", r"\1", text), mode="eval")
    else:
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text


def test_ebnf_output_parses_in_process(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir)
    try:
        outs = run_in_process(
            scheduler,
            [[[1, 2, 3, 4], [5, 6, 7]]],
            {"ebnf": ARITHMETIC_GBNF, "max_new_tokens": 48, "temperature": 0.0},
        )
        for ids in outs:
            _check_arithmetic(scheduler.tokenizer, ids, scheduler.tokenizer.eos_token_id)
        bad = scheduler.make_request(
            "bad", [1, 2], SamplingParams.from_dict({"ebnf": "root ::= ("})
        )
        scheduler.add_request(bad)
        drain(scheduler)
        assert bad.finish_reason is not None
        assert bad.finish_reason.error is ErrorCode.INVALID_CONSTRAINT
    finally:
        scheduler.close()


def test_llguidance_reads_unlisted_properties_as_outlines_does():
    """An object schema that does not mention additionalProperties gets false under llguidance
    too (outlines-core's reading), at every depth, and one that does keeps its own."""
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"x": {"anyOf": [{"type": "object", "properties": {"b": {"type": "string"}}}]}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]["properties"]["properties"]) == {"a"}  # a name, not a keyword
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["$defs"]["x"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


BOUNDED = {
    "type": "object",
    "properties": {
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "step": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5},
    },
    "required": ["level"],
}


def accepted(compiler, tokenizer, text: str, **constraint) -> bool:
    """Whether the constraint takes `text` whole and then EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [compiler.eos_token_id]
    return compiler.compile(**constraint).guide().allowed_prefix(ids) == len(ids)


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_schema_bounds_hold_under_either_backend(tokenizer, backend):
    """Numeric bounds compile with llguidance whatever the backend (outlines-core would ignore
    them); a keyword no backend enforces is refused by name."""
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB, backend=backend)
    try:
        assert compiler.compile(json_schema=BOUNDED).backend == "llguidance"
        for text, ok in (
            ('{"level":1}', True),
            ('{"level":10,"step":2.5}', True),
            ('{"level":0}', False),
            ('{"level":11}', False),
            ('{"level":3,"step":0}', False),
            ('{"level":3,"step":0.75}', False),
        ):
            assert accepted(compiler, tokenizer, text, json_schema=BOUNDED) is ok, text
        unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
        with pytest.raises(ConstraintError, match="'uniqueItems' cannot be enforced"):
            compiler.compile(json_schema=unique)
        unknown = {"type": "string", "format": "no-such-format"}
        with pytest.raises(ConstraintError, match="Unknown format"):
            compiler.compile(json_schema=unknown) if backend == "llguidance" else (
                compiler.compile(lark=f"start: %json {json.dumps(unknown)}")
            )
    finally:
        compiler.close()


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_tools_with_bounds_decode_under_a_grammar(compiler, tokenizer, parser):
    """A tool whose schema has bounds decodes under a Lark grammar (llguidance), in every call
    format: in-range calls pass, out-of-range ones do not, and under `auto` free text may come
    first (the trigger ends it inside one lexeme)."""
    tools = parse_tools(
        [
            {"type": "function", "function": {"name": "volume", "parameters": BOUNDED}},
            {"type": "function", "function": {"name": "now"}},
        ]
    )
    p = PARSERS[parser]
    required = p.constraint(tools, ToolChoice("required"), parallel=True)
    auto = p.constraint(tools, ToolChoice("auto"), parallel=True)
    assert required is not None and auto is not None and required.kind == "lark"
    good = p.format_calls([ToolCall("volume", '{"level":7,"step":1.5}'), ToolCall("now", "{}")])
    bad = p.format_calls([ToolCall("volume", '{"level":70}')])
    assert accepted(compiler, tokenizer, good, **required.params())
    assert not accepted(compiler, tokenizer, bad, **required.params())
    assert accepted(compiler, tokenizer, "Let me see. " + good, **auto.params())
    assert accepted(compiler, tokenizer, "No call needed.", **auto.params())
    assert not accepted(compiler, tokenizer, "Let me see. " + bad, **auto.params())


BOUNDED_RECORD = {
    **RECORD_SCHEMA,
    "properties": {
        **RECORD_SCHEMA["properties"],
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}


def test_jump_forward_and_speculation_keep_the_greedy_text(default_model_dir):
    """On the default model, greedy text under each backend (a plain schema: outlines-core; the
    same with bounds, and GBNF: llguidance) is the same token by token, with jump-forward, and
    with speculative decoding; the bounded age stays in range; sampled GBNF output (T = 1, four
    seeds) parses wherever it finished."""
    constraints = (
        {"json_schema": RECORD_SCHEMA},
        {"json_schema": BOUNDED_RECORD},
        {"ebnf": ARITHMETIC_GBNF},
    )
    texts = {}
    for name, settings in (
        ("token by token", {"enable_jump_forward": False}),
        ("jump-forward", {}),
        ("speculative", {"speculative_algorithm": "ngram"}),
    ):
        scheduler = make_scheduler(default_model_dir, **settings)
        tok = scheduler.tokenizer
        prompt = tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": "Describe Ada from Lisbon as JSON: name, age, city."}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )
        try:
            greedy = {"max_new_tokens": 40, "temperature": 0}
            outs = [run_in_process(scheduler, [[prompt]], {**greedy, **c})[0] for c in constraints]
            texts[name] = [tok.decode(ids, skip_special_tokens=True) for ids in outs]
            if name == "speculative":  # and sampled (T = 1, a seed each): a finished one parses
                for seed in range(4):
                    sampled = {"max_new_tokens": 24, "temperature": 1.0, "seed": seed}
                    (ids,) = run_in_process(scheduler, [[prompt]], {**sampled, **constraints[2]})
                    _check_arithmetic(tok, ids, scheduler.tokenizer.eos_token_id)
            assert_no_leak(scheduler)
        finally:
            scheduler.close()
    assert texts["token by token"] == texts["jump-forward"] == texts["speculative"], texts
    assert 0 <= json.loads(texts["jump-forward"][1])["age"] <= 120


KINDS = (
    ({"regex": r"[0-9]{4}-[0-9]{2}"}, "2024-01"),
    ({"json_schema": RECORD_SCHEMA}, '{"name":"Ada","age":36,"city":"Lisbon"}'),
    ({"choices": ["yes", "no"]}, "no"),
    ({"dtype": "float"}, "-1.5e3"),
    ({"ebnf": ARITHMETIC_GBNF}, "(1+2)*3"),
    ({"lark": PAIRS_LARK}, "{a=1,bc=22}"),
)


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_every_kind_checks_drafts_without_advancing(tokenizer, backend):
    """What speculative verification does with a guide, for every constraint kind under either
    backend: `allowed_prefix` of a draft (whole, or with a bad token inside) leaves the guide
    where it was, so the accepted tokens then advance it to the end."""
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB, backend=backend)
    bad = tokenizer.encode("@", add_special_tokens=False)[0]
    try:
        for constraint, text in KINDS:
            guide = compiler.compile(**constraint).guide()
            ids = tokenizer.encode(text, add_special_tokens=False)
            half = len(ids) // 2
            for _ in range(2):
                assert guide.allowed_prefix(ids + [compiler.eos_token_id]) == len(ids) + 1
                assert guide.allowed_prefix([*ids[:half], bad, *ids[half:]]) == half
            for token in ids[:half]:
                guide.advance(token)
            assert guide.allowed_prefix([*ids[half:], compiler.eos_token_id]) == len(ids) - half + 1
            for token in [*ids[half:], compiler.eos_token_id]:
                guide.advance(token)
            assert guide.allowed_only_eos()
    finally:
        compiler.close()
