"""Constraint compiles are bounded and killable: checks before compiling (a `$ref` expansion budget
among them), worker processes killed at `--constraint-compile-timeout`, a fast lane, a per-tenant
cap and a bounded wait (`overloaded`), a cache keyed per tenant by the constraint as given, every
constraint answered in bounded time, nothing left behind."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from outlines_core.json_schema import build_regex_from_schema
from transformers import AutoTokenizer

from radixrt.client.transport import RemoteError
from radixrt.structured import compiler as compiler_module
from radixrt.structured.compiler import ConstraintCompiler
from radixrt.structured.grammar import CompilerBusy
from radixrt.structured.regexes import (
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    check_expansion,
    check_regex,
    load_schema,
    nesting_depth,
    schema_regex,
)

from helpers import launch_runtime, ref_fan_out
from ownership import assert_no_leak
from timeouts import REPLY_TIMEOUT_S

TIMEOUT_S = 1.0  # the compiler's budget in the lane tests
RUNTIME_TIMEOUT_S = 0.5  # the runtime's --constraint-compile-timeout
RUNTIME_BOUND_S = RUNTIME_TIMEOUT_S + max(RUNTIME_TIMEOUT_S, 1.0)  # the wait, then the compile
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
    # it stops looking past the bound
    assert nesting_depth(deep, MAX_SCHEMA_DEPTH) == MAX_SCHEMA_DEPTH + 1
    with pytest.raises(ValueError, match="nests deeper"):
        load_schema({"type": "array", "items": deep})
    assert schema_regex(nested(MAX_SCHEMA_DEPTH // 2 - 1))  # a deep but bounded one compiles


def test_the_expansion_budget_stops_a_ref_fan_out_before_translating_it():
    schema = ref_fan_out(64)
    assert len(json.dumps(schema)) < 8000
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"over {MAX_REGEX_CHARS} chars.*expansion budget"):
        schema_regex(schema)
    assert time.monotonic() - start < 0.2  # the walk stops at the budget, not at 6.5 MB
    assert schema_regex(ref_fan_out(8))  # a fan-out within the budget translates


@pytest.mark.parametrize(
    "schema",
    [
        ref_fan_out(4),
        ref_fan_out(12),
        {"type": "object", "properties": {f"p{i}": {"type": "number"} for i in range(40)}},
        {"type": "array", "items": {"type": "object", "properties": {"a": {"enum": ["x", 3]}}}},
        {"anyOf": [{"type": ["null", "boolean"]}, {"const": "xyz"}, {"type": "string"}]},
        {"type": "string", "pattern": "[a-z]+"},
        {
            "$defs": {"n": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}},
            "$ref": "#/$defs/n",
        },
    ],
    ids=lambda s: json.dumps(s)[:30],
)
def test_the_expansion_estimate_is_a_lower_bound_of_the_regex(schema):
    """So the budget never refuses a schema whose regex would have fitted."""
    assert check_expansion(schema) <= len(build_regex_from_schema(json.dumps(schema), ""))


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
    heavy = [compiler.compile_async(json_schema=expensive_schema(i), tenant="a") for i in range(3)]
    cheap = compiler.compile_async(regex=r"[0-9]{3}", tenant="a")
    assert _wait(compiler, [cheap], 3.0) < 1.0 and cheap.grammar is not None
    # tenant a holds one slow worker at a time; tenant b's expensive schema starts at once
    other = compiler.compile_async(json_schema=expensive_schema(99), tenant="b")
    assert _wait(compiler, [other], TIMEOUT_S + 2.0) > TIMEOUT_S * 0.9
    assert "too complex: compiling took over 1 s" in str(other.error)
    # a's first one ran its budget; the others waited theirs for a worker: busy, not cached
    assert _wait(compiler, heavy, 2.0) < 1.0
    assert "too complex" in str(heavy[0].error)
    for job in heavy[1:]:
        assert isinstance(job.error, CompilerBusy) and "waited 1 s" in str(job.error)
    assert compiler.stats().longest_s < TIMEOUT_S + 0.5
    start = time.monotonic()  # the verdict is cached for the tenant: a retry fails at once
    retry = compiler.compile_async(json_schema=expensive_schema(0), tenant="a")
    assert retry.error is heavy[0].error and time.monotonic() - start < 0.1
    assert not compiler.compile_async(json_schema=expensive_schema(1), tenant="a").done
    # an expensive regex that looks cheap overruns the fast lane, then gets the rest of its budget
    _wait(compiler, [compiler.compile_async(json_schema=expensive_schema(1), tenant="a")], 5.0)
    killed = compiler.stats().killed
    sneaky = compiler.compile_async(regex="(a|b)*a" + "(a|b)" * 16)  # a DFA of 2^16 states
    _wait(compiler, [sneaky], TIMEOUT_S + 3.0)  # run time, plus starting a slow-lane worker
    assert "too complex" in str(sneaky.error) and compiler.stats().killed == killed + 2
    assert compiler.stats().longest_s < TIMEOUT_S + 0.5
    # idle workers stop on their own
    time.sleep(2.5)
    compiler.poll()
    assert compiler.stats().workers == 0


def test_the_cache_is_per_tenant_and_keyed_before_translation(compiler):
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    first = compiler.compile_async(json_schema=schema, tenant="a")
    _wait(compiler, [first], 5.0)
    started = compiler.stats().started
    # an equal constraint, as a new map or as its text, is a hit: nothing is translated or built
    assert compiler.compile_async(json_schema=json.loads(json.dumps(schema)), tenant="a") is first
    assert compiler.stats().started == started
    # another tenant's identical constraint is its own compile: no timing tells it a's
    other = compiler.compile_async(json_schema=schema, tenant="b")
    assert other is not first and compiler.stats().started == started + 1
    _wait(compiler, [other], 5.0)
    assert other.grammar is not None and other.grammar is not first.grammar
    # a refused check is cached too: the samples of one bad request check it once
    bad = compiler.compile_async(json_schema=ref_fan_out(64), tenant="a")
    assert "expansion budget" in str(bad.error)
    assert compiler.compile_async(json_schema=ref_fan_out(64), tenant="a") is bad
    # a tenant filling the cache evicts its own entries first, not another's
    compiler.cache_size = 4
    kept = compiler.compile_async(regex="[0-9]", tenant="b")
    for i in range(8):
        compiler.compile_async(regex=f"[0-9]{{{i + 2}}}", tenant="a")
    assert compiler.compile_async(regex="[0-9]", tenant="b") is kept


def test_a_tenant_past_its_cap_is_refused_at_once(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    compiler = ConstraintCompiler(
        tokenizer, 49152, compile_timeout_s=TIMEOUT_S, compiles_per_tenant=2
    )
    try:
        held = [
            compiler.compile_async(json_schema=expensive_schema(i), tenant="a") for i in range(2)
        ]
        start = time.monotonic()
        refused = compiler.compile_async(json_schema=expensive_schema(2), tenant="a")
        assert time.monotonic() - start < 0.1
        assert isinstance(refused.error, CompilerBusy) and "at most 2 at once" in str(refused.error)
        # a repeat of one in flight shares it; another tenant is not held to a's cap
        assert compiler.compile_async(json_schema=expensive_schema(0), tenant="a") is held[0]
        assert not compiler.compile_async(json_schema=expensive_schema(0), tenant="b").done
        _wait(compiler, held, 2 * TIMEOUT_S + 2.0)
        assert compiler.stats().refused >= 2  # the cap's refusal and held[1]'s wait
        # once a's compiles have ended, a's next one is taken
        assert not compiler.compile_async(json_schema=expensive_schema(3), tenant="a").done
    finally:
        compiler.close()


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


def test_twenty_distinct_schemas_at_once_are_each_answered_in_bound(runtime):
    """Twenty distinct schemas of one tenant, each seconds to compile: each is answered within
    the wait plus the compile timeout (compiled, too complex, or overloaded past the tenant's
    cap or wait), and a cheap regex sent meanwhile is served at once."""
    runtime.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)  # warm
    server = psutil.Process(runtime._proc.pid)
    threads_before = server.num_threads()
    with ThreadPoolExecutor(21) as pool:
        heavy = [
            pool.submit(
                _timed, runtime, {**GREEDY, "json_schema": {"type": "string", "maxLength": 200 + i}}
            )
            for i in range(20)
        ]
        deadline = time.monotonic() + 10
        while not _compile_workers(runtime):  # the twenty are queued or compiling
            assert time.monotonic() < deadline, "no compile worker started"
            time.sleep(0.05)
        seconds, out = _timed(runtime, {**GREEDY, "regex": "[0-9]{3}"})
        assert seconds < 3.0 and len(out["text"]) == 3 and out["text"].isdigit()
        results = [f.result() for f in heavy]
    codes = [out.code for _, out in results if isinstance(out, RemoteError)]
    for seconds, out in results:
        assert seconds < RUNTIME_BOUND_S + 2.0, (seconds, out)
        assert isinstance(out, RemoteError), out
        assert out.code in ("invalid_constraint", "overloaded"), out
        assert ("too complex" if out.code == "invalid_constraint" else "retry") in out.message
    assert "overloaded" in codes and "invalid_constraint" in codes  # the cap and the budget
    compiles = runtime.stats()["constraint_compiles"]
    assert compiles["longest_s"] < RUNTIME_TIMEOUT_S + 0.5  # each one was killed at its budget
    assert compiles["refused"] >= 20 - 8  # past the default cap of 8 in flight
    deadline = time.monotonic() + 10
    while _compile_workers(runtime) and time.monotonic() < deadline:
        time.sleep(0.2)  # idle workers stop after a few seconds
    assert not _compile_workers(runtime)
    assert server.num_threads() <= threads_before  # no compile thread either
    assert_no_leak(runtime)


def test_a_ref_fan_out_is_refused_beside_a_plain_request(runtime):
    """The fan-out, 64 samples of it, is refused by the expansion budget without being
    translated or built; a plain request sent beside it finishes in seconds."""
    started = runtime.stats()["constraint_compiles"]["started"]
    with ThreadPoolExecutor(2) as pool:
        fan = pool.submit(_timed, runtime, {**GREEDY, "n": 64, "json_schema": ref_fan_out(64)})
        seconds, out = _timed(runtime, GREEDY)
        assert seconds < 3.0 and out["text"]
        seconds, refused = fan.result()
    assert seconds < 3.0 and isinstance(refused, RemoteError), refused
    assert refused.code == "invalid_constraint" and "expansion budget" in refused.message
    assert runtime.stats()["constraint_compiles"]["started"] == started
    assert_no_leak(runtime)


def test_a_refused_constraint_is_answered_while_the_batch_is_full(tiny_model_dir):
    """Admission stops looking once the batch is full, yet a constraint that failed ends its
    request at the next step, its queue entry freed, while the running one decodes on."""
    with launch_runtime(tiny_model_dir, max_running_requests=1) as runtime:
        long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_timed, runtime, long)
            deadline = time.monotonic() + 10
            while runtime.stats()["running"] < 1:
                assert time.monotonic() < deadline, "the long request never ran"
                time.sleep(0.02)
            seconds, refused = _timed(runtime, {**GREEDY, "json_schema": ref_fan_out(64)})
            assert not running.done(), "the batch emptied before the refusal: nothing shown"
            assert seconds < 3.0 and isinstance(refused, RemoteError), refused
            assert refused.code == "invalid_constraint"
            assert len(running.result()[1]["output_ids"]) == 200
        assert_no_leak(runtime)


def _chat(runtime, body: dict) -> tuple[float, int, dict]:
    """POST a chat completion to the gateway: seconds, status, JSON body."""
    request = urllib.request.Request(
        f"{runtime.http_url}/v1/chat/completions",
        data=json.dumps({"model": "tiny", "max_tokens": 4, "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
            status, out = reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        status, out = e.code, json.loads(e.read())
    return time.monotonic() - start, status, out


def test_a_ref_fan_out_tool_is_refused_by_the_gateway_beside_a_plain_chat(tiny_runtime):
    """Tools render on the gateway's event loop: the fan-out is refused by the expansion budget
    before it is translated, and a plain chat sent beside it is answered."""
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_fan_out(64)}}
    with ThreadPoolExecutor(2) as pool:
        fan = pool.submit(_chat, tiny_runtime, {"messages": messages, "tools": [tool]})
        seconds, status, out = _chat(tiny_runtime, {"messages": messages})
        assert status == 200 and seconds < 5.0, out
        seconds, status, out = fan.result()
    assert status == 400 and seconds < 2.0, out
    assert "expansion budget" in out["error"]["message"] and "tools[0]" in out["error"]["message"]


def test_the_samples_of_one_request_compile_once(runtime):
    schema = {"type": "object", "properties": {"once": {"type": "integer"}}, "required": ["once"]}
    started = runtime.stats()["constraint_compiles"]["started"]
    outs = runtime.generate(
        input_ids=[5, 6, 7], sampling_params={**GREEDY, "n": 4, "json_schema": schema}
    )
    assert len(outs) == 4 and all(o["text"].startswith('{"once":') for o in outs)
    assert runtime.stats()["constraint_compiles"]["started"] == started + 1
    assert_no_leak(runtime)


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": {"type": "object", "properties": [{"type": "string"}]}},
        {"json_schema": nested_text(100_000)},
        {"json_schema": "[" * 30_000 + "]" * 30_000},
        # 200 levels of maps: past the schema's 64, within the frame's 256 (protocol.MAX_NESTING;
        # deeper, the frame itself is refused, invalid_request, in tests/server/test_frame_bounds.py)
        {"json_schema": nested(100)},
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
