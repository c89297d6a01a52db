"""What both ends of the wire agree on: stable error codes (docs/protocol.md lists them).

Imported by the client side and the HTTP gateway too, so it needs neither torch nor the engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from typing import Any

import msgpack

MAX_CACHE_SALT_CHARS = 256  # a generate's `cache_salt`, checked by the runtime and the router
# A frame's maps and lists nest at most this deep (the top-level map is depth 1): room for the
# deepest field a request may hold (a JSON schema of 64 levels, `regexes.MAX_SCHEMA_DEPTH`, under
# sampling_params, which the constraint check answers with `invalid_constraint`), and well within
# msgpack's packer (511 levels), so whatever a process re-packs or echoes can be packed.
MAX_NESTING = 256
# a rid is a string of at most this many characters (a router's key for a worker adds ~11)
MAX_RID_CHARS = 1024
# a pin's `pin_id`, checked by the runtime: room for what a router (~11) or the HTTP gateway
# (its caller's scope) puts before a client's own id of at most 256 characters
MAX_PIN_ID_CHARS = 1024


class ErrorCode(str, Enum):
    """The machine-readable `error.code` of a failed request; never reworded once published."""

    INVALID_REQUEST = "invalid_request"  # malformed frame, unknown op, bad field or value
    # the prompt does not fit the context or pool
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    # a regex, JSON schema or choice list that does not compile
    INVALID_CONSTRAINT = "invalid_constraint"
    UNAUTHORIZED = "unauthorized"  # missing or wrong api_key, or a tenant's key on a control op
    OVERLOADED = "overloaded"  # the waiting queue is full; try again later
    RATE_LIMITED = "rate_limited"
    ABORTED = "aborted"
    TIMEOUT = "timeout"
    DRAINING = "draining"
    WORKER_LOST = "worker_lost"
    # said by the client itself: the runtime restarted or went silent
    CONNECTION_LOST = "connection_lost"
    INTERNAL_ERROR = "internal_error"  # a bug: it costs one request, never the server

    @classmethod
    def parse(cls, value: object) -> ErrorCode | None:
        """The code named by `value`, or None for one this side does not know (a newer peer's)."""
        return cls._value2member_map_.get(value)  # type: ignore[return-value]


class RequestError(ValueError):
    """A request the runtime refuses, with the code its client gets."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def wire_rid(rid: Any) -> str | int | None:
    """`rid` as a reply may echo it: a string of at most MAX_RID_CHARS characters or a 64-bit
    int; anything else a sender put there (a nested list, a huge string) is replaced by None,
    so no reply is ever unsendable because of what its request held."""
    if isinstance(rid, str) and len(rid) <= MAX_RID_CHARS:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**64:
        return rid
    return None


def check_rid(rid: Any) -> str:
    """A generate's rid: a non-empty string of at most MAX_RID_CHARS characters (it is echoed
    in every streamed reply), else a ValueError."""
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS:
        raise ValueError(
            f"generate needs a non-empty string rid of at most {MAX_RID_CHARS} characters"
        )
    return rid


def error_reply(rid: Any, code: ErrorCode, message: str) -> dict[str, Any]:
    """The one shape of a failure on the wire; `type` repeats `code` for older clients. The rid
    is echoed only where `wire_rid` allows it."""
    error = {"code": code.value, "type": code.value, "message": message}
    return {"rid": wire_rid(rid), "error": error}


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How deep `value`'s maps and lists nest (a scalar is 0, `{"a": [1]}` is 2), level by
    level without recursion, stopping at `limit + 1` once past `limit`."""
    depth, level = 0, [value]
    while True:
        containers = [v for v in level if isinstance(v, dict | list | tuple)]
        if not containers:
            return depth
        depth += 1
        if depth > limit:
            return depth
        level = []
        for c in containers:
            if isinstance(c, dict):
                level.extend(c)  # keys: msgpack makes a list key a tuple
                level.extend(c.values())
            else:
                level.extend(c)


# Control ops: only the admin key (`--admin-api-key`) may send them; a tenant's key gets
# `unauthorized`. Clients send these with their admin key (RuntimeClient.admin_api_key).
ADMIN_OPS = frozenset(
    {
        "shutdown",
        "flush_cache",
        "memory_snapshot",
        "check_invariants",
        "load_lora_adapter",
        "unload_lora_adapter",
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "init_weights_update_group",
        "update_weights_from_distributed",
        "destroy_weights_update_group",
        "pause_generation",
        "continue_generation",
        "release_memory_occupation",
        "resume_memory_occupation",
    }
)


def tensor_handoff_dir() -> str | None:
    """Where named tensors are handed to the runtime as safetensors files on its machine (an
    `rt.Engine`'s `update_weights_from_tensor`, a trainer group's broadcast): /dev/shm where
    this process may write there (the tensors never touch a disk), else the temp default."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


# how long a caller (the HTTP gateway, a router) waits for a weight update's answer: the update
# first waits for the requests in flight to finish, then loads (docs/rl.md)
WEIGHT_UPDATE_WAIT_S = 3600.0

DEFAULT_TENANT_LABEL = "default"  # how the tenant "" (no key file) is named in stats


def tenant_label(tenant: str) -> str:
    """A tenant's name in `stats()["tenants"]` and /metrics."""
    return tenant or DEFAULT_TENANT_LABEL


def decode_map(
    payload: bytes, limits: Mapping[str, int] | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A received frame as `(map, None)`, or `(None, the error reply its sender gets)` when it
    is not msgpack or not a map. `limits` are msgpack's size limits (`max_str_len`, ...), so an
    untrusted frame cannot unpack into more than they allow. Never more than msgpack: nothing
    is ever unpickled."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False, **(limits or {}))
    except Exception as e:  # any undecodable frame
        return None, error_reply(
            None, ErrorCode.INVALID_REQUEST, f"frame is not msgpack within the limits: {e}"
        )
    if not isinstance(msg, dict):
        return None, error_reply(None, ErrorCode.INVALID_REQUEST, "a message must be a msgpack map")
    if nesting_depth(msg) > MAX_NESTING:
        return None, error_reply(
            None, ErrorCode.INVALID_REQUEST, f"maps and lists nest deeper than {MAX_NESTING}"
        )
    return msg, None
