"""The request contract: `GenerateOptions` (radixrt/protocol.py) declares each request field
once, and `SamplingParams` (radixrt/sampling_params.py) each sampling parameter; every surface
is derived from them: the ZeroMQ generate's field set, the OpenAI and native HTTP bodies, the
engine's scope, the router's namespace, the client's options and docs/protocol.md's tables. So
is each control op from its record (`CONTROL_OPS`): the runtime's and the router's op tables,
the gateway's routes, both endpoints' methods. Model-free, except the last test, which sends
every declared field over each surface of a real runtime and gateway."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import msgpack
import pytest
import zmq
from pydantic import ValidationError

import radixrt as rt
from radixrt.client.base import Endpoint, RequestOptions
from radixrt.engine.request import RequestScope
from radixrt.protocol import (
    ADMIN_KEYED_OPS,
    ADMIN_OPS,
    CONTROL_OPS,
    GENERATE_BASE_FIELDS,
    GENERATE_FIELDS,
    ErrorCode,
    Fleet,
    GenerateOptions,
    InitWeightsUpdateGroup,
    ListLoraAdapters,
    ModelInfo,
    ReleaseMemoryOccupation,
    Stats,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    generate_fields,
    internal_error_text,
    option_fields,
    request_field,
    spec_of,
)
from radixrt.protocol_doc import control_table, field_table, sampling_table
from radixrt.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams, param
from radixrt.server.front import PROBE
from radixrt.server.http.schemas import Body, CompletionRequest, GenerateRequest, request_body
from radixrt.server.http.sglang_native import NativeGenerateRequest, _per_prompt_fields
from radixrt.server.router.prefix_tree import Namespace
from radixrt.server.router.router import Router, namespace_of
from radixrt.server.zmq_server import CONTROL, OPS

from helpers import http_json
from timeouts import REPLY_TIMEOUT_S

OPTIONS = {f.name for f in option_fields()}


def _check_even(name, value):
    if not isinstance(value, int) or value % 2:
        raise ValueError(f"{name} must be an even integer")


@dataclass(frozen=True, kw_only=True)
class Extended(GenerateOptions):
    """What a contributor adds: one declaration (issue 42's `sampling_seed`, say)."""

    sampling_seed: int | None = request_field(
        doc="an even integer", example=2, check=_check_even, per_prompt=True, namespace=True
    )


def test_an_internal_error_tells_no_server_path() -> None:
    """An unexpected exception's text reaches the caller with each absolute path cut to its
    last part: the file is named, the server's layout is not."""
    missing = FileNotFoundError(2, "No such file", "/srv/cache/radixrt/models/x-1f/config.json")
    assert (
        internal_error_text(missing) == "FileNotFoundError: [Errno 2] No such file: 'config.json'"
    )
    socket = OSError("cannot connect to ipc:///tmp/radixrt-77/engine (from /a/b)")
    assert internal_error_text(socket) == "OSError: cannot connect to ipc://engine (from b)"
    plain = ValueError("ratio 1/2 of ./relative/file, ~/home/kept")
    assert internal_error_text(plain) == "ValueError: ratio 1/2 of ./relative/file, ~/home/kept"


def test_positional_construction_raises():
    """A field inserted between two others cannot silently shift them: no positions at all."""
    with pytest.raises(TypeError):
        GenerateOptions("salt")  # type: ignore[misc]
    with pytest.raises(TypeError):
        RequestOptions("salt", 1)  # type: ignore[misc]
    assert RequestOptions(cache_salt="s", api_key="k").fields() == {
        "cache_salt": "s",
        "api_key": "k",
    }


def test_a_new_field_reaches_every_surface():
    """Declared once in a subclass, the field is in the ZeroMQ field set, both HTTP bodies
    (per prompt in the native one), the docs table, the wire map and the namespace."""
    assert generate_fields(Extended) == GENERATE_FIELDS | {"sampling_seed"}
    native = request_body(Body, native=True, options=Extended)
    assert native.model_validate({"sampling_seed": [2, 4]}).sampling_seed == [2, 4]
    openai = request_body(Body, native=False, options=Extended)
    assert openai.model_validate({"sampling_seed": 2}).sampling_seed == 2
    with pytest.raises(ValidationError):
        openai.model_validate({"sampling_seed": [2]})  # a list is the native body's only
    table = field_table(Extended)
    assert "| `sampling_seed` | integer | `2` |" in table and "an even integer" in table
    options = Extended.from_wire({"sampling_seed": 4, "cache_salt": "s", "other": 1})
    assert options.wire() == {"cache_salt": "s", "sampling_seed": 4}
    assert options.namespace() == {"cache_salt": "s", "lora_path": "", "sampling_seed": 4}
    with pytest.raises(ValueError, match="sampling_seed must be an even integer"):
        Extended.from_wire({"sampling_seed": 3})


@dataclass(kw_only=True)
class MoreSampling(SamplingParams):
    """A sampling parameter a contributor adds (issue 42's `no_stop_trim`, say)."""

    no_stop_trim: bool = param(
        False, kind=bool, openai="no_stop_trim", native=True, doc="keep the stop string"
    )


def test_a_new_sampling_parameter_reaches_every_surface():
    """Declared once, it is checked by kind, taken by the OpenAI bodies under its name there
    and by the native /generate top level, and listed in the docs table."""
    assert MoreSampling.from_dict({"no_stop_trim": True}).no_stop_trim is True
    with pytest.raises(ValueError, match="no_stop_trim must be of type bool"):
        MoreSampling.from_dict({"no_stop_trim": 1})
    openai = request_body(Body, native=False, sampling=MoreSampling)
    assert openai.model_validate({"no_stop_trim": True, "min_tokens": 2}).no_stop_trim is True
    native = request_body(Body, native=True, sampling=MoreSampling)
    assert native.model_validate({"no_stop_trim": True}).no_stop_trim is True
    with pytest.raises(ValidationError, match="min_new_tokens"):  # only top-level ones natively
        native.model_validate({"min_new_tokens": 2})
    assert "| `no_stop_trim` | boolean | `false` | OpenAI bodies (`no_stop_trim`), native" in (
        sampling_table(MoreSampling)
    )
    with pytest.raises(TypeError):
        SamplingParams(16)  # type: ignore[misc]


def test_openai_sampling_fields_go_to_the_wire_by_their_wire_names():
    body = CompletionRequest(prompt="x", min_tokens=2, stop="s", temperature=0, cache_salt="c")
    assert body.sampling_params(8) == {
        "max_new_tokens": 8,
        "min_new_tokens": 2,
        "stop": "s",
        "temperature": 0,
    }
    assert NativeGenerateRequest(text="x", return_logprob=True).return_logprob is True
    assert GENERATION_CONFIG_FIELDS == (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
    )


def test_the_served_surfaces_are_the_declared_ones():
    """What the server uses is what the declaration derives, and nothing else names a field."""
    assert GENERATE_FIELDS == frozenset(GENERATE_BASE_FIELDS) | OPTIONS
    assert OPTIONS <= set(NativeGenerateRequest.model_fields)
    openai = {f.name for f in option_fields() if spec_of(f).openai}
    assert OPTIONS & set(GenerateRequest.model_fields) == openai
    assert "lora_path" in OPTIONS - openai  # over OpenAI's bodies `model` names the adapter
    assert {f.name for f in dataclasses.fields(RequestOptions)} == OPTIONS | {"api_key"}
    examples = {f.name: spec_of(f).example for f in option_fields()}
    assert GenerateOptions.from_wire(examples).wire() == examples
    scope = RequestScope.from_fields("alice", examples)
    assert {k: getattr(scope, k) for k in examples} == examples and scope.tenant == "alice"
    assert namespace_of("alice", examples) == Namespace(
        "alice", examples["cache_salt"], examples["lora_path"]
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cache_salt": 3}, "cache_salt must be a string of at most 256 chars"),
        ({"cache_salt": "x" * 257}, "cache_salt must be a string of at most 256 chars"),
        ({"lora_path": ["a"]}, "lora_path must be a string of at most 256 chars"),
        ({"priority": "high"}, "priority must be an integer"),
        ({"priority": True}, "priority must be an integer"),
        ({"timeout": 0}, r"timeout must be a number of seconds > 0"),
        ({"timeout": float("nan")}, r"timeout must be a number of seconds > 0"),
    ],
)
def test_a_bad_value_is_refused_by_name_by_the_runtime_and_the_router(fields, message):
    with pytest.raises(ValueError, match=message):
        RequestScope.from_fields("", fields)
    with pytest.raises(ValueError, match=message):
        namespace_of("", fields)


def test_unknown_body_fields_are_refused_by_name():
    with pytest.raises(ValidationError, match="lora_pth"):
        NativeGenerateRequest.model_validate({"text": "x", "lora_pth": "a"})
    with pytest.raises(ValidationError, match="lora_path"):  # OpenAI's: `model` names it
        CompletionRequest.model_validate({"prompt": "x", "lora_path": "a"})


def test_per_prompt_fields_are_one_value_or_one_per_prompt():
    one = NativeGenerateRequest(text=["a", "b"], lora_path="x")
    assert _per_prompt_fields(one, 2) == [{"lora_path": "x"}, {"lora_path": "x"}]
    each = NativeGenerateRequest(text=["a", "b"], lora_path=["x", "y"])
    assert _per_prompt_fields(each, 2) == [{"lora_path": "x"}, {"lora_path": "y"}]
    assert _per_prompt_fields(NativeGenerateRequest(text=["a", "b"]), 2) == [{}, {}]
    with pytest.raises(Exception, match="lora_path must be one value or one per prompt"):
        _per_prompt_fields(NativeGenerateRequest(text=["a", "b"], lora_path=["x"]), 2)


def _zmq_generate(url: str, msg: dict) -> dict:
    """One generate map straight on a DEALER socket (no client in between); its final reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        sock.send(msgpack.packb({"op": "generate", "rid": "r", **msg}))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while time.monotonic() < deadline:
            if sock.poll(1000):
                reply = msgpack.unpackb(sock.recv(), raw=False)
                if reply != PROBE and (reply.get("finished") or "error" in reply):
                    return reply
        raise TimeoutError("no reply to the generate")
    finally:
        sock.close()
        ctx.term()


# control ops the endpoints send their own way: the transport's heartbeat, a property read
# once, what only `rt.Engine` (which writes the tensors) can send, and `rt.Runtime.shutdown`
# (which waits for its process too)
SERVED_OTHERWISE = {"ping", "model_info", "update_weights_from_tensor", "shutdown"}


def test_every_control_op_is_served_from_its_record():
    """Each record has the runtime's handler, an entry in the router's table as its `fleet`
    says, its gateway route when it declares one, and a method on both endpoints (but those a
    transport serves its own way)."""
    records = set(CONTROL_OPS.values())
    assert set(CONTROL) == records
    router = Router._ops(object.__new__(Router))  # the table only names bound methods
    for name, record in CONTROL_OPS.items():
        assert OPS[name].record is record and router[name].record is record
        assert OPS[name].answers == (not record.waits)
        assert router[name].answers == (
            record.fleet is Fleet.WORKERS_ONLY or name in {"ping", "shutdown"}
        )
        if name not in SERVED_OTHERWISE:
            assert callable(getattr(Endpoint, name)), f"no endpoint method {name}"
    assert isinstance(Endpoint.model_info, property)
    assert callable(rt.Engine.update_weights_from_tensor) and callable(rt.Runtime.shutdown)
    app_routes = _app_routes()
    for record in records:
        if record.route is not None:
            assert (record.route.method, f"/{record.op}") in app_routes
    assert control_table().count("\n") == len(records) + 1


def _app_routes() -> set[tuple[str, str]]:
    """The (method, path) of every route `add_control_routes` adds (none is called here)."""
    from fastapi import FastAPI

    from radixrt.server.http.control import add_control_routes

    app = FastAPI()
    add_control_routes(app, None)
    return {(m, r.path) for r in app.routes for m in getattr(r, "methods", ())}


GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}


@pytest.mark.parametrize(
    ("record", "fields", "message"),
    [
        (
            InitWeightsUpdateGroup,
            {**GROUP, "extra": 1},
            "unknown init_weights_update_group fields: ['extra']",
        ),
        (
            InitWeightsUpdateGroup,
            {**GROUP, "master_port": True},
            "master_port must be of type integer",
        ),
        (
            InitWeightsUpdateGroup,
            {**GROUP, "master_port": 70000},
            "master_port must be an integer in 0 to 65535",
        ),
        (
            InitWeightsUpdateGroup,
            {**GROUP, "rank_offset": 2},
            "rank_offset must be in [1, world_size)",
        ),
        (InitWeightsUpdateGroup, {**GROUP, "backend": "nccl"}, 'backend must be of type `"gloo"`'),
        (InitWeightsUpdateGroup, {"master_address": "x"}, "needs master_port (integer)"),
        (UpdateWeightsFromDisk, {"model_path": ""}, "model_path must be a string of 1 to 4096"),
        (
            UpdateWeightsFromDisk,
            {"model_path": "m", "weight_version": 7},
            "weight_version must be of type string",
        ),
        (
            UpdateWeightsFromDistributed,
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[1, "2"]]},
            "shapes[0][1] must be of type integer",
        ),
        (
            UpdateWeightsFromDistributed,
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "flush_cache": False},
            "flush_cache must be of type `true`",
        ),
        (ReleaseMemoryOccupation, {"tags": ["weights"]}, "tags[0] must be of type"),
    ],
)
def test_a_control_op_refuses_what_its_record_does_not_declare(record, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        record.from_wire({"op": record.op, "rid": "r", **fields})


def test_a_control_op_goes_over_the_wire_and_back_unchanged():
    for op in (
        InitWeightsUpdateGroup(**GROUP),
        UpdateWeightsFromDisk("/m", "v1", True, "safetensors"),
        UpdateWeightsFromDistributed(["a"], ["bfloat16"], [[2, 3]], "g"),
        ReleaseMemoryOccupation(["kv_cache"]),
    ):
        assert type(op).from_wire(msgpack.unpackb(msgpack.packb(op.wire()))) == op


def test_a_results_server_paths_are_the_admins_only():
    """`seen_by` leaves out the fields a record declares as the server's paths, for anyone but
    the admin, from a map and from each map of a list; the clients send those ops with their
    admin key (`ADMIN_KEYED_OPS`), as they send control ops and `stats`."""
    info = {"model": "tiny", "model_path": "/srv/m", "tokenizer_path": "/srv/t", "vocab_size": 8}
    assert ModelInfo.seen_by(info, admin=True) == info
    assert ModelInfo.seen_by(info, admin=False) == {"model": "tiny", "vocab_size": 8}
    adapters = [{"name": "a1", "path": "/srv/a1", "rank": 8}]
    assert ListLoraAdapters.seen_by(adapters, admin=False) == [{"name": "a1", "rank": 8}]
    assert Stats.seen_by({"tenants": {}}, admin=False) == {"tenants": {}}  # it declares none
    assert {"model_info", "list_lora_adapters", "stats"} | ADMIN_OPS <= ADMIN_KEYED_OPS


@pytest.mark.model
def test_every_declared_field_is_served_on_every_surface(tiny_runtime):
    """Each field's example is accepted by ZeroMQ's generate, the native /generate and (where
    declared) /v1/completions; a field no declaration names is refused by name on each."""
    examples = {f.name: spec_of(f).example for f in option_fields()}
    openai = {f.name: spec_of(f).example for f in option_fields() if spec_of(f).openai}
    params = {"max_new_tokens": 2, "temperature": 0}
    http = tiny_runtime.http_url
    reply = _zmq_generate(tiny_runtime.url, {"text": "Hi", "sampling_params": params, **examples})
    assert reply["finished"] and "error" not in reply, reply
    status, body = http_json(
        f"{http}/generate", {"text": "Hi", "sampling_params": params, **examples}
    )
    assert status == 200, body
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    status, body = http_json(f"{http}/v1/completions", {**completion, **openai})
    assert status == 200, body
    reply = _zmq_generate(tiny_runtime.url, {"text": "Hi", "cache_slat": "s"})
    assert reply["error"]["code"] == ErrorCode.INVALID_REQUEST.value
    assert reply["error"]["message"] == "unknown generate fields: ['cache_slat']"
    for path, body in [
        ("/generate", {"text": "Hi", "cache_slat": "s"}),
        ("/v1/completions", {**completion, "cache_slat": "s"}),
    ]:
        status, answer = http_json(f"{http}{path}", body)
        assert status == 400 and "cache_slat" in answer["error"]["message"], answer
