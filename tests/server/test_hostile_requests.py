"""Every request is a guest: generated requests with values at and past their bounds (tiny and
huge floats, NaN and inf, huge ints, ids past the vocabulary), constraints of the wrong types and
deep nesting, and many long stop strings, sent as raw frames to a live runtime. Every reply is a
result or a typed error other than `internal_error`, and the same process then serves a normal
request with no leaked slot (hypothesis, tiny model)."""

from __future__ import annotations

import time
import uuid

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from radixrt.reliability.hostile import deep_schema, markdown, run_hostile
from radixrt.server.front import PROBE

from ownership import assert_no_leak
from timeouts import REPLY_TIMEOUT_S

VOCAB = 49152  # the tiny model's
INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-6, 1e-5, 1e300, 2.0, 100.0, 100.0001]),
    INTS,
    st.sampled_from([-1, 0, 1, 64, 65, 1 << 20, (1 << 20) + 1, VOCAB - 1, VOCAB, 2**63]),
)
ANYTHING = st.one_of(
    NUMBERS,
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(min_value=-2, max_value=2 * VOCAB), max_size=6),
    st.dictionaries(st.text(max_size=4), INTS, max_size=3),
)
TOKEN_IDS = st.lists(
    st.one_of(
        st.integers(min_value=3, max_value=VOCAB - 1),
        st.sampled_from([-1, VOCAB, VOCAB + 1, 2**40, 2**64 - 1]),
    ),
    max_size=12,
)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
SCHEMAS = st.one_of(
    ANYTHING,
    JSON_VALUES,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "string", "array", 5, None])},
        optional={
            "properties": st.one_of(JSON_VALUES, st.lists(st.text(max_size=3), max_size=3)),
            "required": st.one_of(ANYTHING, st.lists(st.text(max_size=3), max_size=3)),
            "items": JSON_VALUES,
            "maxLength": NUMBERS,
            "enum": JSON_VALUES,
        },
    ),
    st.sampled_from([10, 600, 100_000]).map(deep_schema),
)
REGEXES = st.one_of(
    ANYTHING,
    st.text(alphabet="ab()[]{}|*+?\\.^$0-9,", max_size=24),
    st.sampled_from([100, 10_000, 100_000]).map(lambda k: "(" * k + "a" + ")" * k),
)
STOPS = st.one_of(
    ANYTHING,
    st.lists(st.text(min_size=0, max_size=3000), max_size=80),
)
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.one_of(st.integers(min_value=0, max_value=6), NUMBERS),
        "min_new_tokens": NUMBERS,
        "temperature": NUMBERS,
        "top_p": NUMBERS,
        "top_k": NUMBERS,
        "min_p": NUMBERS,
        "frequency_penalty": NUMBERS,
        "presence_penalty": NUMBERS,
        "repetition_penalty": NUMBERS,
        "n": NUMBERS,
        "seed": NUMBERS,
        "top_logprobs_num": NUMBERS,
        "logprob_start_len": NUMBERS,
        "return_logprob": ANYTHING,
        "ignore_eos": ANYTHING,
        "stop": STOPS,
        "stop_token_ids": st.one_of(ANYTHING, TOKEN_IDS),
        "regex": REGEXES,
        "json_schema": SCHEMAS,
        "choices": st.one_of(ANYTHING, st.lists(st.text(max_size=20), max_size=6)),
        "dtype": ANYTHING,
        "no_such_field": ANYTHING,
    },
)
REQUESTS = st.fixed_dictionaries(
    {"sampling_params": st.one_of(PARAMS, PARAMS, PARAMS, ANYTHING)},
    optional={
        "input_ids": st.one_of(TOKEN_IDS, ANYTHING),
        "text": st.one_of(st.text(max_size=40), ANYTHING),
        "stream": ANYTHING,
        "cache_salt": ANYTHING,
        "priority": NUMBERS,
        "timeout": NUMBERS,
    },
)


@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir):
    with runtimes.lease(
        tiny_model_dir,
        constraint_compile_timeout=3.0,
        log_level="error",
    ) as r:
        yield r


@pytest.fixture(scope="module")
def dealer(runtime):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(runtime.url)
    yield sock
    sock.close()
    ctx.term()


def _exchange(sock: zmq.Socket, msg: dict) -> list[dict]:
    """Send one generate and read its replies until its final one (or an error) per sample."""
    rid = uuid.uuid4().hex
    sock.send(msgpack.packb({**msg, "op": "generate", "rid": rid}, use_bin_type=True))
    replies, deadline = [], time.monotonic() + REPLY_TIMEOUT_S
    n = (
        msg.get("sampling_params", {}).get("n", 1)
        if isinstance(msg.get("sampling_params"), dict)
        else 1
    )
    wanted = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 64 else 1
    while time.monotonic() < deadline:
        assert sock.poll(int((deadline - time.monotonic()) * 1000) + 1), f"no reply to {msg!r:.300}"
        reply = msgpack.unpackb(sock.recv(), raw=False)
        if reply == PROBE:  # the runtime checks that this client is still there
            continue
        assert reply.get("rid") == rid, f"a reply for someone else: {reply!r:.300}"
        replies.append(reply)
        if "error" in reply or sum(bool(r.get("finished")) for r in replies) == wanted:
            return replies
    raise AssertionError(f"no final reply to {msg!r:.300}")


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(msg=REQUESTS)
# the four requests that stopped the runtime for good before they were checked at admission
@example(msg={"sampling_params": {"temperature": 1e-300, "max_new_tokens": 2}})
@example(msg={"sampling_params": {"stop_token_ids": [VOCAB + 7], "min_new_tokens": 2}})
@example(msg={"sampling_params": {"json_schema": {"type": "object", "properties": ["a"]}}})
@example(msg={"sampling_params": {"json_schema": deep_schema(100_000)}})
def test_any_request_gets_a_result_or_a_typed_error(runtime, dealer, msg):
    msg = {"input_ids": [5, 6, 7], **msg, "timeout": msg.get("timeout", 30)}
    replies = _exchange(dealer, msg)
    errors = [r["error"] for r in replies if "error" in r]
    assert not [e for e in errors if e["code"] == "internal_error"], (msg, errors)
    assert all(e["message"] for e in errors)


def test_the_runtime_serves_on_with_nothing_leaked(runtime, dealer):
    """Runs after the generated requests: the same process answers a normal request."""
    out = runtime.generate(
        input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert len(out["output_ids"]) == 4
    assert_no_leak(runtime)


def test_every_class_of_bad_input_gets_a_typed_error(runtime):
    """The classes `radixrt.reliability.hostile` tabulates for docs/reliability.md."""
    info = runtime.model_info
    results = run_hostile(runtime.url, info["vocab_size"], info["context_length"])
    print(markdown(results))
    assert [(r.name, r.internal_errors, r.unanswered, r.server_deaths) for r in results] == [
        (r.name, 0, 0, 0) for r in results
    ]
