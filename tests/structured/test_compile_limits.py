"""Constraint compiles are bounded and killable: checks before compiling, worker processes killed
at `--constraint-compile-timeout`, a fast lane and a per-tenant cap, nothing left behind."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from radixrt.client.transport import RemoteError
from radixrt.structured import compiler as compiler_module
from radixrt.structured.compiler import ConstraintCompiler
from radixrt.structured.regexes import (
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    check_regex,
    load_schema,
    nesting_depth,
    schema_regex,
)

from helpers import launch_runtime
from ownership import assert_no_leak

TIMEOUT_S = 1.0  # the compiler's budget in the lane tests
RUNTIME_TIMEOUT_S = 0.5  # the runtime's --constraint-compile-timeout: twenty of them run in turn
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def expensive_schema(i: int) -> dict:
    """An object of two long strings: its automaton takes seconds (well past TIMEOUT_S) and
    hundreds of MB; `i` makes each one a different constraint (no shared build, no cached verdict)."""
    text = {"type": "string", "maxLength": 250}
    return {
        "type": "object",
        "properties": {f"a{i}": text, f"b{i}": text},
        "required": [f"a{i}", f"b{i}"],
    }


def nested_text(depth: int) -> str:
    """`nested(depth)` as JSON text, written without recursion (json.dumps would overflow)."""
    return '{"type":"object","properties":{"x":' * depth + '{"type":"integer"}' + "}}" * depth


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


# ---- the checks, without a model -----------------------------------------------------------
@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "object", "properties": [{"type": "string"}]}, "'properties' must be an object"),
        ({"type": "object", "properties": {"a": 3}}, "must be an object or a boolean"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"}, "required"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": [1]}, "required"),
        ({"anyOf": {"type": "string"}}, "'anyOf' must be a non-empty array"),
        ({"anyOf": []}, "'anyOf' must be a non-empty array"),
        ({"type": "array", "items": "string"}, "'items' must be a schema"),
        ({"type": 7}, "'type' must be a string"),
        ({"type": "string", "maxLength": "9"}, "'maxLength' must be a non-negative integer"),
        ({"type": "string", "maxLength": True}, "'maxLength' must be a non-negative integer"),
        ({"type": "string", "pattern": 5}, "'pattern' must be a string"),
        ({"$ref": ["#/x"]}, "'\\$ref' must be a string"),
        ({"enum": "ab"}, "'enum' must be an array"),
        ([{"type": "string"}], "must be a JSON object"),
        ("[1, 2]", "must be a JSON object"),
        ("7", "must be a JSON object"),
        ("{", "not valid JSON"),
        (nested(MAX_SCHEMA_DEPTH), "nests deeper"),
        ("[" * 30_000 + "]" * 30_000, "nests deeper"),  # json.loads' RecursionError
        (nested_text(100_000), "chars"),
        (nested_text(MAX_SCHEMA_CHARS // 40), "nests deeper"),
    ],
)
def test_bad_schemas_are_refused_before_compiling(schema, words):
    with pytest.raises(ValueError, match=words):
        schema_regex(schema)


def test_schema_checks_do_not_recurse():
    deep: list = []
    for _ in range(100_000):  # deeper than Python's recursion limit
        deep = [deep]
    assert nesting_depth(deep) == MAX_SCHEMA_DEPTH + 1  # it stops looking past the bound
    with pytest.raises(ValueError, match="nests deeper"):
        load_schema({"type": "array", "items": deep})
    assert schema_regex(nested(MAX_SCHEMA_DEPTH // 2 - 1))  # a deep but bounded one compiles


def test_regex_checks():
    for bad, words in ((5, "must be a string"), ("a" * 70_000, "chars"), ("\ud800", "Unicode")):
        with pytest.raises(ValueError, match=words):
            check_regex(bad)
    check_regex("[0-9]{3}")


# ---- the compiler's lanes, with the default tokenizer --------------------------------------
@pytest.fixture
def compiler(default_model_dir):
    compiler = ConstraintCompiler(
        AutoTokenizer.from_pretrained(default_model_dir), 49152, compile_timeout_s=TIMEOUT_S
    )
    yield compiler
    compiler.close()
    assert compiler.stats().workers == 0
    assert not [p for p in psutil.Process().children() if _is_compile_worker(p)]


def _wait(compiler: ConstraintCompiler, jobs: list, limit_s: float) -> float:
    start = time.monotonic()
    while not all(compiler.ready(j) for j in jobs):
        assert time.monotonic() - start < limit_s, "a compile outlived its budget"
        time.sleep(0.01)
    return time.monotonic() - start


def test_fast_lane_and_tenant_cap(compiler):
    heavy = [compiler.compile_async(json_schema=expensive_schema(i), tenant="a") for i in range(4)]
    cheap = compiler.compile_async(regex=r"[0-9]{3}", tenant="a")
    assert _wait(compiler, [cheap], 3.0) < 1.0 and cheap.grammar is not None
    # tenant a holds one slow worker at a time; tenant b's expensive schema starts at once
    other = compiler.compile_async(json_schema=expensive_schema(99), tenant="b")
    assert _wait(compiler, [other], TIMEOUT_S + 2.0) > TIMEOUT_S * 0.9
    assert "too complex: compiling took over 1 s" in str(other.error)
    assert sum(j.done for j in heavy) <= 3
    _wait(compiler, heavy, 4 * TIMEOUT_S + 5.0)
    assert all("too complex" in str(j.error) for j in heavy)
    assert compiler.stats().longest_s < TIMEOUT_S + 0.5
    start = time.monotonic()  # the verdict is cached: a retry fails at once
    assert compiler.compile_async(json_schema=expensive_schema(0)).error is heavy[0].error
    assert time.monotonic() - start < 0.1
    # an expensive regex that looks cheap overruns the fast lane, then gets the rest of its budget
    killed = compiler.stats().killed
    sneaky = compiler.compile_async(regex="(a|b)*a" + "(a|b)" * 16)  # a DFA of 2^16 states
    _wait(compiler, [sneaky], TIMEOUT_S + 3.0)  # run time, plus starting a slow-lane worker
    assert "too complex" in str(sneaky.error) and compiler.stats().killed == killed + 2
    assert compiler.stats().longest_s < TIMEOUT_S + 0.5
    # idle workers stop on their own
    time.sleep(2.5)
    compiler.poll()
    assert compiler.stats().workers == 0


def test_a_compile_past_its_memory_limit_fails_alone(default_model_dir, monkeypatch):
    """The worker's RLIMIT_AS ends a build that outgrows it (the allocation aborts the child)
    long before the time budget; the job fails, and a new worker serves the next one."""
    monkeypatch.setattr(compiler_module, "WORKER_MEMORY_BYTES", 128 << 20)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    compiler = ConstraintCompiler(tokenizer, 49152, compile_timeout_s=60)
    try:
        job = compiler.compile_async(json_schema=expensive_schema(7))
        assert _wait(compiler, [job], 30) < 30
        assert "too complex: its compile ran out of memory (128 MiB)" in str(job.error)
        assert compiler.compile(regex="[0-9]{2}") is not None
    finally:
        compiler.close()


# ---- a real runtime --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runtime(tiny_model_dir):
    with launch_runtime(tiny_model_dir, constraint_compile_timeout=RUNTIME_TIMEOUT_S) as r:
        yield r


def _is_compile_worker(process: psutil.Process) -> bool:
    try:
        return any(Path(arg).name == "compile_worker.py" for arg in process.cmdline())
    except psutil.Error:  # gone meanwhile
        return False


def _compile_workers(runtime) -> list[psutil.Process]:
    server = psutil.Process(runtime._proc.pid)
    return [p for p in server.children(recursive=True) if _is_compile_worker(p)]


def _timed(runtime, params: dict) -> tuple[float, dict | RemoteError]:
    start = time.monotonic()
    try:
        out = runtime.generate(input_ids=[5, 6, 7], sampling_params=params)
    except RemoteError as e:
        out = e
    return time.monotonic() - start, out


def test_twenty_expensive_schemas_do_not_hold_up_a_cheap_regex(runtime):
    runtime.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)  # warm
    server = psutil.Process(runtime._proc.pid)
    threads_before = server.num_threads()
    with ThreadPoolExecutor(21) as pool:
        heavy = [
            pool.submit(_timed, runtime, {**GREEDY, "json_schema": expensive_schema(i)})
            for i in range(20)
        ]
        deadline = time.monotonic() + 10
        while not _compile_workers(runtime):  # the twenty are queued or compiling
            assert time.monotonic() < deadline, "no compile worker started"
            time.sleep(0.05)
        seconds, out = _timed(runtime, {**GREEDY, "regex": "[0-9]{3}"})
        assert seconds < 3.0 and len(out["text"]) == 3 and out["text"].isdigit()
        results = [f.result() for f in heavy]
    for _, out in results:
        assert isinstance(out, RemoteError) and out.code == "invalid_constraint", out
        assert "too complex" in out.message
    compiles = runtime.stats()["constraint_compiles"]
    assert compiles["longest_s"] < RUNTIME_TIMEOUT_S + 0.5  # each one was killed at its budget
    assert compiles["killed"] >= 20
    deadline = time.monotonic() + 10
    while _compile_workers(runtime) and time.monotonic() < deadline:
        time.sleep(0.2)  # idle workers stop after a few seconds
    assert not _compile_workers(runtime)
    assert server.num_threads() <= threads_before  # no compile thread either
    assert_no_leak(runtime)


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": {"type": "object", "properties": [{"type": "string"}]}},
        {"json_schema": nested_text(100_000)},
        {"json_schema": "[" * 30_000 + "]" * 30_000},
        {"json_schema": nested(200)},
        {"json_schema": {"type": "array", "items": "integer"}},
        {"json_schema": {"anyOf": {"type": "integer"}}},
        {
            "json_schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": 1,
            }
        },
        {"regex": "("},
        {"regex": "a" * 70_000},
        {"choices": ["x"] * 5000},
    ],
    ids=lambda c: json.dumps(c)[:40],
)
def test_bad_constraints_cost_one_request(runtime, constraint):
    with pytest.raises(RemoteError) as e:
        runtime.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, **constraint})
    assert e.value.code == "invalid_constraint", e.value
    out = runtime.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "regex": "[a-c]{2}"})
    assert len(out["text"]) == 2
    assert_no_leak(runtime)
