"""What both ends of the wire agree on: stable error codes (docs/protocol.md lists them) and the
request contract, `GenerateOptions`: the fields of a generate beside its prompt and sampling, from
which the ZeroMQ field set, the HTTP request bodies, the cache scope and namespace, and the docs'
field table are derived.

Imported by the client side and the HTTP gateway too, so it needs neither torch nor the engine.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

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


# ---- the request contract ------------------------------------------------------------------
# A generate map's fields that are not options: the op, its rid, the prompt, sampling, streaming.
GENERATE_BASE_FIELDS = ("op", "rid", "text", "input_ids", "sampling_params", "stream")


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """How one `GenerateOptions` field travels and is checked.

        `doc`: its line in docs/protocol.md's field table; `example`: a value every server accepts
    (the table shows it; tests send it over each surface). `check(name, value)` raises a ValueError
        naming the field for a value it refuses (None, "not sent", is never checked). `unset`: what
        the engine reads when a request leaves it out. `openai`: a field of the OpenAI-compatible
        bodies (/v1/completions, /v1/chat/completions) too, not only of ZeroMQ's `generate` and the
        native /generate. `per_prompt`: the native /generate also takes a list, one per prompt.
        `namespace`: it names the cache namespace (prefixes are shared only within one), so pins
        carry it and a router's trees are keyed by it."""

    doc: str
    example: Any
    check: Callable[[str, Any], None]
    unset: Any = None
    openai: bool = True
    per_prompt: bool = False
    namespace: bool = False


def request_field(**spec: Any) -> Any:
    """A `GenerateOptions` field: None (not sent) by default, its `FieldSpec(**spec)` in its
    metadata."""
    return field(default=None, metadata={"spec": FieldSpec(**spec)})


def _short_string(name: str, value: Any) -> None:
    if not isinstance(value, str) or len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"{name} must be a string of at most {MAX_CACHE_SALT_CHARS} chars")


def _integer(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer")


def _seconds(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0")


OptionsT = TypeVar("OptionsT", bound="GenerateOptions")


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """A generate's request-level fields beside its prompt and sampling, declared once: each
    field's `FieldSpec` says where it travels and how it is checked. The ZeroMQ `generate`
    map's field set (`generate_fields`), the HTTP bodies' fields (server/http/schemas.py), the
    engine's `RequestScope`, a router's `Namespace`, the client's `RequestOptions` and the
    table in docs/protocol.md are all derived from here, so a new field is added here (and
    where its behaviour lives) and nowhere else. Keyword construction only: a field added
    between two others cannot shift them. None: not sent."""

    cache_salt: str | None = request_field(
        doc=f"a string of at most {MAX_CACHE_SALT_CHARS} characters: prefixes are shared only among "
        "requests of the same salt and tenant",
        example="tenant-a",
        check=_short_string,
        unset="",
        namespace=True,
    )
    priority: int | None = request_field(
        doc="an integer, default 0: higher runs first (`--schedule-low-priority-values-first`: "
        "lower), capped by the tenant's `maxprio`",
        example=0,
        check=_integer,
        unset=0,
    )
    timeout: float | None = request_field(
        doc="seconds > 0 from arrival: past it the request ends with error `timeout`",
        example=60.0,
        check=_seconds,
    )
    lora_path: str | None = request_field(
        doc='the name of a loaded LoRA adapter (absent or `""`: the base model; a name not loaded: '
        "`invalid_request`); over OpenAI's bodies `model` names it",
        example="",
        check=_short_string,
        unset="",
        openai=False,
        per_prompt=True,
        namespace=True,
    )

    @classmethod
    def from_wire(cls: type[OptionsT], msg: Mapping[str, Any]) -> OptionsT:
        """The options a generate (or pin) map carries, each checked: a ValueError names the
        first bad one. `msg`'s other keys are not read (`generate_fields` bounds them)."""
        values = {f.name: msg.get(f.name) for f in option_fields(cls)}
        for f in option_fields(cls):
            if values[f.name] is not None:
                spec_of(f).check(f.name, values[f.name])
        return cls(**values)

    def wire(self) -> dict[str, Any]:
        """The options set, as a generate map carries them."""
        return {
            f.name: getattr(self, f.name)
            for f in option_fields(type(self))
            if getattr(self, f.name) is not None
        }

    def resolved(self) -> dict[str, Any]:
        """Every option, those not sent as their `unset` value: what the engine reads."""
        return {
            f.name: spec_of(f).unset if getattr(self, f.name) is None else getattr(self, f.name)
            for f in option_fields(type(self))
        }

    def namespace(self) -> dict[str, Any]:
        """The options naming the cache namespace, resolved (a router's `Namespace` fields)."""
        resolved = self.resolved()
        fields = option_fields(type(self))
        return {f.name: resolved[f.name] for f in fields if spec_of(f).namespace}

    def over(self: OptionsT, defaults: OptionsT) -> OptionsT:
        """These options, with `defaults`' where these say nothing (None)."""
        unset = {
            f.name: getattr(defaults, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is None
        }
        return dataclasses.replace(self, **unset)


def spec_of(f: dataclasses.Field[Any]) -> FieldSpec:
    spec: FieldSpec = f.metadata["spec"]
    return spec


def option_fields(
    options: type[GenerateOptions] = GenerateOptions,
) -> tuple[dataclasses.Field[Any], ...]:
    """The request fields `options` declares (a subclass's own too; `RequestOptions`' `api_key`,
    a frame field, has no `FieldSpec` and is not one)."""
    return tuple(f for f in dataclasses.fields(options) if "spec" in f.metadata)


def generate_fields(options: type[GenerateOptions] = GenerateOptions) -> frozenset[str]:
    """What a generate map may hold (its `api_key` is read, and removed, by the front before);
    any other field is refused by name."""
    return frozenset(GENERATE_BASE_FIELDS) | {f.name for f in option_fields(options)}


GENERATE_FIELDS = generate_fields()
