"""`python -m radixrt.reliability.hostile`: classes of bad input against a live runtime, tabulated.

Each class is a list of generate maps a careless or hostile client could send: sampling values
at and past their bounds, token ids past the vocabulary, constraints of the wrong types, deep
nesting, stop lists too long, prompts past the context. Every one goes out on a raw DEALER
socket (so the client library's own checks cannot soften it), its reply is read, and after each
class a normal request must still be served. The table (docs/reliability.md) counts, per class,
the requests sent, the typed errors and results they got, the `internal_error`s (target 0) and
the server deaths (target 0).
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

REPLY_TIMEOUT_S = 60.0
NASTY_NUMBERS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    1e-300,
    5e-324,
    -1,
    0,
    2**31,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1e300,
    "1",
    None,
    True,
    [],
    {},
]
# sampling params of constraints: values of the wrong types, and patterns and schemas that break
WRONG_CONSTRAINTS: tuple[dict[str, Any], ...] = (
    {"regex": 5},
    {"regex": ["a"]},
    {"regex": {"a": 1}},
    {"regex": "(unclosed"},
    {"regex": "a{99999999}"},
    {"json_schema": 5},
    {"json_schema": ["a"]},
    {"json_schema": "{not json"},
    {"json_schema": {"type": "object", "properties": ["a"]}},
    {"json_schema": {"type": "object", "properties": {"a": 5}}},
    {"json_schema": {"type": "object", "required": 3}},
    {"json_schema": {"type": "array", "items": "x"}},
    {"json_schema": {"type": 7}},
    {"json_schema": {"anyOf": {"a": 1}}},
    {"choices": []},
    {"choices": [1, 2]},
    {"choices": "abc"},
    {"dtype": "complex"},
    {"regex": "a", "json_schema": {"type": "integer"}},
)
NUMERIC_PARAMS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "n",
    "seed",
    "top_logprobs_num",
    "logprob_start_len",
)


def nested_array(depth: int, leaf: bytes = b"\x01") -> bytes:
    """A msgpack value: `depth` one-element arrays around `leaf` (raw bytes, so deeper than
    msgpack's packer would build)."""
    return b"\x91" * depth + leaf


def raw_map(*entries: tuple[str, bytes]) -> bytes:
    """A msgpack map of string keys to raw msgpack values (at most 15 entries)."""
    return bytes([0x80 | len(entries)]) + b"".join(msgpack.packb(k) + v for k, v in entries)


def frame_attacks(api_key: str | None) -> list[bytes]:
    """Frames that once stopped a router or a TP runtime (issue 39), sent with `api_key` or
    without: rids nested past the decoder's bound (1,024 and 300 levels) and within it, a rid too long to
    echo, a map where a key belongs, rids at the edges of 64 bits, deep sampling params, and
    frames that are not a map at all. Each must cost its sender a reply at most."""
    auth = [("api_key", msgpack.packb(api_key))] if api_key else []
    health, generate = msgpack.packb("health"), msgpack.packb("generate")
    return [
        raw_map(("rid", nested_array(1024)), ("op", health), *auth),
        raw_map(("rid", nested_array(300)), ("op", health), *auth),
        raw_map(("rid", nested_array(20)), ("op", health), *auth),
        raw_map(("rid", msgpack.packb("r" * 5000)), ("op", generate), *auth),
        b"\x81" + msgpack.packb({"x": list(range(60))}) + msgpack.packb(1),
        raw_map(("op", generate), ("rid", msgpack.packb(2**64 - 1)), *auth),
        raw_map(("op", generate), ("rid", msgpack.packb(-(2**63))), *auth),
        raw_map(
            *auth,
            ("op", generate),
            ("rid", msgpack.packb("x")),
            ("sampling_params", nested_array(200, msgpack.packb({}))),
        ),
        b"\x01",
        b"\xc1",
        b"",
    ]


def deep_schema(depth: int) -> str:
    """A JSON schema nested `depth` objects deep, as text (msgpack packs at most 512 levels)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


def bad_input_classes(vocab_size: int, context_length: int) -> dict[str, list[dict[str, Any]]]:
    """Generate maps (without op and rid) by class; each asks for at most a few tokens."""
    small: dict[str, Any] = {"max_new_tokens": 2}
    v = vocab_size
    past_vocabulary: tuple[dict[str, Any], ...] = (
        {"stop_token_ids": [v], "min_new_tokens": 1},
        {"stop_token_ids": [2**64 - 1]},
        {"stop_token_ids": [-3]},
        {"top_k": v + 1},
        {"top_k": 2**63 - 1},
    )
    return {
        "sampling values at and past their bounds": [
            {"input_ids": [5, 6, 7], "sampling_params": {**small, name: value}}
            for name in NUMERIC_PARAMS
            for value in NASTY_NUMBERS
        ],
        "token ids past the vocabulary": [
            {"input_ids": ids, "sampling_params": small}
            for ids in ([v], [v + 1], [-1], [2**64 - 1], [5, v * 2], [])
        ]
        + [{"input_ids": [5, 6], "sampling_params": small | p} for p in past_vocabulary],
        "constraints of the wrong types": [
            {"text": "hi", "sampling_params": {**small, **c}} for c in WRONG_CONSTRAINTS
        ],
        "deep nesting": [
            {"text": "hi", "sampling_params": {**small, **c}}
            for depth in (100, 1_000, 10_000, 100_000)
            for c in (
                {"json_schema": deep_schema(depth)},
                {"regex": "(" * depth + "a" + ")" * depth},
            )
        ],
        "stop strings": [
            {"text": "hi", "sampling_params": {**small, "stop": s}}
            for s in (
                [str(i) for i in range(1000)],
                ["x" * 100_000],
                ["x" * 2000] * 40,
                5,
                [""],
                [None],
            )
        ],
        "prompts": [
            {"text": ""},
            {"text": b"bytes"},
            {"text": 5},
            {"input_ids": "abc"},
            {"input_ids": [5] * (context_length + 10)},
            {"text": "hi " * (context_length * 2)},
            {"text": "hi", "input_ids": [5]},
            {"input_ids": [True, False]},
        ],
        "other fields": [
            {"text": "hi", "sampling_params": "not a map"},
            {"text": "hi", "sampling_params": {**small, "no_such_param": 1}},
            {"text": "hi", "sampling_params": small, "priority": 2**63 - 1},
            {"text": "hi", "sampling_params": small, "priority": "urgent"},
            {"text": "hi", "sampling_params": small, "timeout": float("nan")},
            {"text": "hi", "sampling_params": small, "timeout": -1},
            {"text": "hi", "sampling_params": small, "cache_salt": "s" * 10_000},
            {"text": "hi", "sampling_params": small, "stream": "yes"},
        ],
    }


@dataclass
class ClassResult:
    """What one class of bad input got."""

    name: str
    sent: int = 0
    results: int = 0  # served after all (a value that was within bounds)
    errors: Counter[str] = field(default_factory=Counter)  # typed errors by code
    unanswered: int = 0
    server_deaths: int = 0

    @property
    def internal_errors(self) -> int:
        return self.errors["internal_error"]


class HostileClient:
    """A raw DEALER on the runtime: sends one map, reads its replies to the end."""

    def __init__(self, url: str, api_key: str | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.api_key = api_key

    def exchange(
        self, msg: dict[str, Any], timeout: float = REPLY_TIMEOUT_S
    ) -> list[dict[str, Any]]:
        """The replies to one op, up to its error or final reply ([] if none came in time)."""
        rid = uuid.uuid4().hex
        frame = {**msg, "rid": rid, **({"api_key": self.api_key} if self.api_key else {})}
        self.sock.send(msgpack.packb(frame, use_bin_type=True))
        replies: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            reply = msgpack.unpackb(self.sock.recv(), raw=False, strict_map_key=False)
            if reply.get("rid") != rid:
                continue  # a late reply to an earlier, timed-out exchange
            replies.append(reply)
            if "error" in reply or "result" in reply or _all_finished(msg, replies):
                return replies
            if time.monotonic() >= deadline:
                break
        return replies

    def alive(self) -> bool:
        """A normal request is served."""
        replies = self.exchange(
            {"op": "generate", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
        )
        return bool(replies) and "error" not in replies[-1]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _all_finished(msg: dict[str, Any], replies: list[dict[str, Any]]) -> bool:
    params = msg.get("sampling_params")
    n = params.get("n", 1) if isinstance(params, dict) else 1
    wanted = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 64 else 1
    return sum(bool(r.get("finished")) for r in replies) >= wanted


def run_hostile(
    url: str, vocab_size: int, context_length: int, api_key: str | None = None
) -> list[ClassResult]:
    """Every class against the runtime at `url`, in order."""
    from tqdm import tqdm

    client = HostileClient(url, api_key)
    results: list[ClassResult] = []
    try:
        classes = bad_input_classes(vocab_size, context_length)
        bar = tqdm(total=sum(map(len, classes.values())), desc="bad inputs", unit="req")
        for name, msgs in classes.items():
            result = ClassResult(name)
            for msg in msgs:
                replies = client.exchange({"op": "generate", **msg})
                result.sent += 1
                if not replies:
                    result.unanswered += 1
                elif "error" in replies[-1]:
                    result.errors[replies[-1]["error"].get("code")] += 1
                else:
                    result.results += 1
                bar.update()
            result.server_deaths = int(not client.alive())
            results.append(result)
        bar.close()
    finally:
        client.close()
    return results


def markdown(results: list[ClassResult]) -> str:
    rows = [
        "| class | sent | typed errors (by code) | served | internal_error | unanswered | server deaths |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        codes = ", ".join(
            f"`{c}` {k}" for c, k in sorted(r.errors.items()) if c != "internal_error"
        )
        typed = sum(k for c, k in r.errors.items() if c != "internal_error")
        rows.append(
            f"| {r.name} | {r.sent} | {typed} ({codes}) | {r.results} | {r.internal_errors} "
            f"| {r.unanswered} | {r.server_deaths} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running runtime (tcp://...); else one is started")
    parser.add_argument("--model", default="default", help="the model of the runtime started")
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)
    import radixrt as rt
    from radixrt.client.endpoint import connect

    if args.url:
        endpoint = connect(args.url, api_key=args.api_key)
        info = endpoint.model_info
        print(
            markdown(
                run_hostile(args.url, info["vocab_size"], info["context_length"], args.api_key)
            )
        )
        return
    with rt.Runtime(model=args.model, log_level="error") as runtime:
        info = runtime.model_info
        print(markdown(run_hostile(runtime.url, info["vocab_size"], info["context_length"])))


if __name__ == "__main__":
    main()
