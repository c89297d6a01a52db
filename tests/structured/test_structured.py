"""Constrained generation end to end on the default model: outputs always match / validate, with
jump-forward decoding on and off."""

from __future__ import annotations

import json
import re
import threading

import pytest

import radixrt as rt

from helpers import RECORD_SCHEMA, launch_runtime
from timeouts import REPLY_TIMEOUT_S

REGEXES = {
    "integer": r"-?[0-9]{1,6}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "choice": r"(red|green|blue)",
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "maxDigits": 3},
    },  # outlines' own bound
    "required": ["name", "age"],
}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {"person": PERSON, "city": {"type": "string", "maxLength": 12}},
        "required": ["person", "city"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    "enum-optional": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green"]},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["color"],
    },
    "ref": {
        "$defs": {"p": PERSON},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/p"}},
        "required": ["a"],
    },
}


def _valid(value, schema, defs) -> bool:
    if "$ref" in schema:
        return _valid(value, defs[schema["$ref"].split("/")[-1]], defs)
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(schema.get("required", [])) <= set(value) <= set(props)
            and all(_valid(v, props[k], defs) for k, v in value.items())
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
            and all(_valid(v, schema["items"], defs) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    return isinstance(value, int) and not isinstance(value, bool)


SAMPLES = 20


@pytest.fixture(scope="module", params=[True, False], ids=["jump-forward", "token-by-token"])
def engine(request, default_model_dir):
    """Jump-forward is on by default: the shared default runtime; off: a runtime of its own."""
    if request.param:
        yield request.getfixturevalue("default_runtime")
        return
    with launch_runtime(default_model_dir, max_total_tokens=8192, enable_jump_forward=False) as e:
        yield e


def _prompt(engine, request: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize("name", list(REGEXES))
def test_regex_outputs_always_match(engine, name):
    prompt = _prompt(engine, f"Write one {name}.")
    greedy = engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 32, "regex": REGEXES[name]}
    )
    sampled = engine.generate(
        prompt,
        {"temperature": 1.0, "max_new_tokens": 32, "regex": REGEXES[name], "n": SAMPLES, "seed": 3},
    )
    for out in [greedy, *sampled]:
        assert re.fullmatch(REGEXES[name], out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_outputs_parse_and_validate(engine, name):
    schema = SCHEMAS[name]
    prompt = _prompt(engine, "Reply with JSON.")
    outs = [
        engine.generate(prompt, {"temperature": 0, "max_new_tokens": 96, "json_schema": schema})
    ]
    outs += engine.generate(
        prompt,
        {
            "temperature": 1.0,
            "max_new_tokens": 96,
            "json_schema": json.dumps(schema),
            "n": SAMPLES,
            "seed": 5,
        },
    )
    for out in outs:
        assert _valid(json.loads(out["text"]), schema, schema.get("$defs", {})), out["text"]


def test_mixed_batch_leaves_free_requests_unchanged(engine):
    free = [_prompt(engine, q) for q in ("Name a fruit.", "What is rain?")]
    expected = engine.generate(free, {"temperature": 0, "max_new_tokens": 16})
    prompts = free + [_prompt(engine, "A number?")] * 2
    params = [{"temperature": 0, "max_new_tokens": 16}] * 2 + [
        {"temperature": 0, "max_new_tokens": 16, "dtype": "int"}
    ] * 2
    outs = engine.generate(prompts, params)
    assert [o["output_ids"] for o in outs[:2]] == [e["output_ids"] for e in expected]
    assert all(re.fullmatch(r"-?(0|[1-9][0-9]*)", o["text"]) for o in outs[2:])


def test_bad_constraints_fail_only_their_request(engine):
    prompt = _prompt(engine, "Hi")
    with pytest.raises(ValueError, match="regex"):
        engine.generate(prompt, {"regex": "(unclosed"})
    with pytest.raises(ValueError):
        engine.generate(prompt, {"json_schema": {"type": "object"}})  # free-form: would explode
    with pytest.raises(ValueError):
        engine.generate(prompt, {"regex": "a", "dtype": "int"})
    assert engine.generate(prompt, {"max_new_tokens": 3})["meta_info"]["completion_tokens"] <= 3
    engine.check_invariants()


def test_constrained_decoding_survives_preemption(default_model_dir):
    with rt.Engine(
        model=str(default_model_dir),
        max_total_tokens=160,
        max_running_requests=8,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    ) as engine:
        prompt = _prompt(engine, "List some numbers.")
        pattern = r"[0-9]{2}(, [0-9]{2}){10,14}"
        outs = engine.generate(
            prompt, {"temperature": 0.7, "seed": 1, "n": 6, "max_new_tokens": 60, "regex": pattern}
        )
        assert engine.stats()["num_preemptions"] > 0
        assert all(re.fullmatch(pattern, o["text"]) for o in outs)


def test_jump_forward_saves_forward_passes(default_runtime):
    """Forced keys and punctuation come in one extend: fewer forwards than output tokens."""
    out = default_runtime.generate(
        _prompt(default_runtime, "A person as JSON."),
        {"temperature": 0, "max_new_tokens": 64, "json_schema": RECORD_SCHEMA},
    )
    meta = out["meta_info"]
    assert meta["forward_passes"] < meta["completion_tokens"] - 6, meta
    assert set(json.loads(out["text"])) == {"name", "age", "city"}


def test_streamed_deltas_join_to_the_constrained_result(engine):
    prompt = _prompt(engine, "A person as JSON.")
    params = {"temperature": 0, "max_new_tokens": 64, "json_schema": RECORD_SCHEMA}
    chunks = list(engine.generate(prompt, params, stream=True))
    final = chunks[-1]
    assert final["finished"] and "".join(c["delta"] for c in chunks[:-1]) == final["text"]
    assert final["text"] == engine.generate(prompt, params)["text"]
    json.loads(final["text"])


def test_stop_string_inside_forced_text(engine):
    out = engine.generate(
        _prompt(engine, "A person as JSON."),
        {"temperature": 0, "max_new_tokens": 64, "json_schema": RECORD_SCHEMA, "stop": '"age"'},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"age"'}
    assert out["text"].startswith('{"name":"') and '"age"' not in out["text"]


def test_abort_constrained_stream_frees_its_slots(engine):
    rid = f"json-abort-{id(engine)}"
    stream = engine.generate(
        _prompt(engine, "Many numbers."),
        {"temperature": 1.0, "max_new_tokens": 400, "regex": r"[0-9]{1,3}(,[0-9]{1,3}){150,}"},
        stream=True,
        rid=rid,
    )
    next(stream)
    threading.Thread(target=engine.abort, args=(rid,)).start()
    final = [c for c in stream if c["finished"]][0]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.flush_cache()
    stats = engine.stats()
    assert stats["free_tokens"] == stats["total_tokens"]
    engine.check_invariants()
