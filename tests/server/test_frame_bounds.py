"""No frame, keyed or not, stops a process that reads a client socket (issue 39, items 1-2).

Model-free: the envelope scan builds nothing but a string key, a string `api_key` and a scalar
`rid`; decoding bounds nesting; replies echo only sendable rids and never raise; the front's
per-turn budget and per-peer refusal budget. Then each hostile shape against a plain runtime,
a `--tp-size 2` runtime and a `--dp-size 2` fleet (the router), after which a fresh client is
served; and a keyless flood during which a real request is answered.
"""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import pytest
import zmq

import radixrt as rt
from radixrt.protocol import (
    MAX_NESTING,
    ErrorCode,
    decode_map,
    error_reply,
    nesting_depth,
    wire_rid,
)
from radixrt.reliability.hostile import frame_attacks, nested_array, raw_map
from radixrt.server.front import (
    FRAMES_PER_TURN,
    REFUSAL_BURST,
    ClientFront,
    FrontConfig,
    LogThrottle,
    Op,
    PeerBudget,
    read_envelope,
)

from helpers import launch_runtime
from timeouts import REPLY_TIMEOUT_S

KEY = "the-key"
SHORT = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


# ---- model-free ------------------------------------------------------------------------------
def test_the_envelope_scan_builds_no_key_other_than_a_string():
    payload = b"\x82" + msgpack.packb({"k": list(range(50))}) + b"\x01" + msgpack.packb("rid")
    with pytest.raises(ValueError, match="key is not a string"):
        read_envelope(payload + msgpack.packb("r"))


def test_the_envelope_reads_only_scalar_rids_and_string_keys():
    frame = raw_map(("rid", nested_array(1024)), ("api_key", msgpack.packb(7)))
    assert read_envelope(frame).rid is None and read_envelope(frame).api_key is None
    frame = raw_map(("rid", msgpack.packb(12)), ("api_key", msgpack.packb("k")))
    assert (read_envelope(frame).rid, read_envelope(frame).api_key) == (12, "k")


def test_decoding_refuses_maps_nested_past_the_bound():
    ok = raw_map(("rid", nested_array(MAX_NESTING - 1)))
    assert decode_map(ok)[1] is None
    deep = raw_map(("rid", nested_array(MAX_NESTING)))
    msg, error = decode_map(deep)
    assert msg is None and "nest deeper" in error["error"]["message"]
    assert error["rid"] is None


def test_nesting_depth_counts_keys_and_values_and_stops_past_its_limit():
    assert [nesting_depth(v) for v in (1, {}, {"a": [1]}, {(1, (2,)): 1}, [[[[]]]])] == [
        0,
        1,
        2,
        3,
        4,
    ]
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    assert nesting_depth(deep) == MAX_NESTING + 1


@pytest.mark.parametrize(
    "rid, echoed",
    [
        ("r1", "r1"),
        (7, 7),
        (2**64 - 1, 2**64 - 1),
        (2**64, None),
        (True, None),
        ([1], None),
        ({"a": 1}, None),
        ("x" * 5000, None),
        (None, None),
        (1.5, None),
    ],
)
def test_error_replies_echo_only_sendable_rids(rid, echoed):
    reply = error_reply(rid, ErrorCode.INVALID_REQUEST, "no")
    assert reply["rid"] == echoed == wire_rid(rid)
    msgpack.packb(reply)


def test_a_peers_refusals_are_answered_up_to_a_burst_then_at_a_rate():
    budget = PeerBudget(rate=1000.0, burst=3)
    assert [budget.take(b"a") for _ in range(4)] == [True, True, True, False]
    assert budget.take(b"b")
    time.sleep(0.01)
    assert budget.take(b"a")


class _Front:
    """A real ClientFront on an ipc socket with a test op table, and a DEALER connected to it."""

    def __init__(self, tmp_path, ops: dict[str, Op]):
        self.ctx = zmq.Context()
        url = f"ipc://{tmp_path}/front.sock"
        self.front = ClientFront(self.ctx, url, FrontConfig(api_key=KEY), ops)
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.connect(url)

    def send(self, payload: bytes, turns: int = 1) -> list[dict]:
        self.client.send(payload)
        for _ in range(turns):
            self.front.drain(200)
        replies = []
        while self.client.poll(100):
            replies.append(msgpack.unpackb(self.client.recv(), raw=False))
        return replies

    def close(self) -> None:
        self.client.close(0)
        self.front.close()
        self.ctx.term()


def test_a_reply_that_cannot_be_packed_becomes_an_internal_error(tmp_path):
    ops = {
        "huge": Op(lambda caller, msg: 2**70),
        "boom": Op(lambda caller, msg: (_ for _ in ()).throw(KeyError("bug"))),
    }
    f = _Front(tmp_path, ops)
    try:
        [reply] = f.send(msgpack.packb({"api_key": KEY, "op": "huge", "rid": "h"}))
        assert reply["rid"] == "h" and reply["error"]["code"] == "internal_error"
        [reply] = f.send(msgpack.packb({"api_key": KEY, "op": "boom", "rid": [[1]]}))
        assert reply["rid"] is None and reply["error"]["code"] == "internal_error"
    finally:
        f.close()


def test_a_front_survives_every_hostile_frame_and_answers_a_keyed_one_after(tmp_path):
    f = _Front(tmp_path, {"health": Op(lambda caller, msg: True)})
    try:
        for key in (None, KEY):
            for frame in frame_attacks(key):
                for reply in f.send(frame):
                    assert "error" in reply or reply.get("result") is True
                    assert reply["rid"] is None or isinstance(reply["rid"], str | int)
        [reply] = f.send(msgpack.packb({"api_key": KEY, "op": "health", "rid": "ok"}))
        assert reply == {"rid": "ok", "result": True}
    finally:
        f.close()


def test_one_turn_reads_a_bounded_number_of_frames_and_refusals_are_rate_limited(tmp_path):
    f = _Front(tmp_path, {"health": Op(lambda caller, msg: True)})
    try:
        for _ in range(FRAMES_PER_TURN + 100):
            f.client.send(b"\x01")
        time.sleep(0.5)  # every frame has arrived
        f.front.drain(0)
        assert f.front.sock.poll(0), "one turn read past its budget"
        f.front.drain(0)
        replies = 0
        while f.client.poll(100):
            f.client.recv()
            replies += 1
        assert REFUSAL_BURST <= replies < REFUSAL_BURST + 20  # the rest dropped unanswered
    finally:
        f.close()


# ---- real processes --------------------------------------------------------------------------
def _send_all(url: str, frames: list[bytes]) -> None:
    """Send each frame from a fresh DEALER, reading whatever comes back within a moment."""
    ctx = zmq.Context()
    try:
        for frame in frames:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
            sock.send(frame)
            if sock.poll(2000):
                reply = msgpack.unpackb(sock.recv(), raw=False)
                assert "error" in reply or "result" in reply
            sock.close()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    "layout", [{}, {"tp_size": 2}, {"dp_size": 2}], ids=["plain", "tp2", "dp2"]
)
def test_no_hostile_frame_stops_a_runtime_a_tp_runtime_or_a_fleet(runtimes, tiny_model_dir, layout):
    with runtimes.lease(tiny_model_dir, api_key=KEY, **layout) as runtime:
        _send_all(runtime.url, frame_attacks(None) + frame_attacks(KEY))
        fresh = rt.RuntimeEndpoint(runtime.url, api_key=KEY, timeout=REPLY_TIMEOUT_S)
        try:
            out = fresh.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
            assert out["meta_info"]["completion_tokens"] == 4
        finally:
            fresh.close()
        assert runtime._proc.poll() is None


@pytest.mark.parametrize("layout", [{}, {"dp_size": 2}], ids=["plain", "dp2"])
def test_a_request_is_answered_during_a_keyless_flood(runtimes, tiny_model_dir, layout):
    with runtimes.lease(tiny_model_dir, api_key=KEY, **layout) as runtime:
        stop, sent = threading.Event(), [0]

        def flood() -> None:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(runtime.url)
            while not stop.is_set():
                try:
                    sock.send(b"\x01", zmq.NOBLOCK)
                    sent[0] += 1
                except zmq.Again:
                    time.sleep(0.001)
            ctx.destroy(linger=0)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            time.sleep(1)
            start = time.monotonic()
            client = rt.RuntimeEndpoint(runtime.url, api_key=KEY, timeout=8)
            try:
                out = client.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
            finally:
                client.close()
            took = time.monotonic() - start
            assert out["meta_info"]["completion_tokens"] == 4
            assert not stop.is_set() and took < 8, f"answered after {took:.1f} s"
            time.sleep(max(0.0, 4 - took))  # the flood goes on to 5 s at least; the process lives
        finally:
            stop.set()
            flooder.join()
        assert sent[0] > 1000 and runtime._proc.poll() is None


def test_a_frame_that_outgrows_the_limit_at_the_router_is_refused_not_sent(tiny_model_dir):
    """The router re-packs a generate under its own rid: a frame just under the limit from the
    client may pack past it for the worker, which would drop the router's connection and every
    request in flight there. It is refused instead, and both workers stay in rotation."""
    limit = 64 << 10
    with launch_runtime(tiny_model_dir, dp_size=2, max_frame_bytes=limit) as fleet:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(fleet.url)
        try:
            base = {"op": "generate", "rid": "big", "sampling_params": SHORT, "text": ""}
            pad = limit - len(msgpack.packb(base)) - 8  # the text's own header takes 3 bytes
            frame = msgpack.packb({**base, "text": "a" * pad})
            assert limit - 8 < len(frame) <= limit
            sock.send(frame)
            assert sock.poll(int(REPLY_TIMEOUT_S * 1000))
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["rid"] == "big" and reply["error"]["code"] == "invalid_request"
            assert "--max-frame-bytes" in reply["error"]["message"]
        finally:
            ctx.destroy(linger=0)
        out = fleet.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
        assert out["meta_info"]["completion_tokens"] == 4
        assert all(w["alive"] for w in fleet.stats()["workers"])


def test_a_flood_of_one_warning_is_logged_once_with_a_count(caplog):
    throttle = LogThrottle(logging.getLogger("test-throttle"))
    with caplog.at_level(logging.WARNING, logger="test-throttle"):
        for _ in range(100):
            throttle.note("the same")
        throttle.note("another")
    assert [r.getMessage() for r in caplog.records] == [
        "the same (0 like it held back)",
        "another (0 like it held back)",
    ]
    assert throttle.held == {"the same": 99}
