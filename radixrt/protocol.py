"""What both ends of the wire agree on: stable error codes (docs/protocol.md lists them) and the
request contract, `GenerateOptions`: the fields of a generate beside its prompt and sampling, from
which the ZeroMQ field set, the HTTP request bodies, the cache scope and namespace, and the docs'
field table are derived.

Imported by the client side and the HTTP gateway too, so it needs neither torch nor the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from types import UnionType
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

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


# an absolute path inside a message (after a space, quote, bracket, '=' or '://'), to its last part
_SERVER_PATH = re.compile(
    r"(?:(?<=://)|(?<![\w.~/-]))/(?:[^\s'\"`,;()\[\]{}<>/]+/)+([^\s'\"`,;()\[\]{}<>/]*)"
)


def internal_error_text(e: BaseException) -> str:
    """What a caller is told of an unexpected exception: its type and message, each absolute
    path cut to its last part (`/srv/models/x/config.json` -> `config.json`). An internal
    error's text comes from code the caller cannot see (an OSError naming a cache file, a
    socket path), so it reaches tenants without the server's layout; the log keeps it whole."""
    return f"{type(e).__name__}: " + _SERVER_PATH.sub(r"\1", str(e))


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


# ---- control ops -----------------------------------------------------------------------------
# Every op but generate, abort, tokenize and pin is one record below: its fields (types, bounds,
# defaults, in SGLang's order), who may send it, what a router does with it, its HTTP route and
# what it answers. The runtime's and the router's op tables, the gateway's rollout routes, both
# client endpoints' methods and docs/protocol.md's table of control ops all come from here.


class Fleet(str, Enum):
    """What a router does with an op."""

    ALL = "all"  # sends it to every live worker and answers once they all have
    ONE = "one"  # asks one live worker
    ROUTER = "router"  # answers it itself
    WORKERS_ONLY = "workers only"  # refuses it: each worker is sent it directly


class HttpReply(str, Enum):
    """The body a rollout route answers 200 with, from the op's result (SGLang's shapes)."""

    RESULT = "the result"
    SUCCESS = '`{"success": result}`'
    MERGED = '`{"success": true, **result}`'
    UPDATE = "the result and a `message` naming the weight version served"

    def answer(self, result: Any) -> Any:
        """The route's body for the op's `result`."""
        if self is HttpReply.SUCCESS:
            return {"success": result}
        if self is HttpReply.MERGED:
            return {"success": True, **result}
        if self is HttpReply.UPDATE:
            return {**result, "message": f"serving weight version {result['weight_version']}"}
        return result

    def result_of(self, answer: Any) -> Any:
        """The op's result from the route's body (what `answer` made of it)."""
        if self is HttpReply.SUCCESS:
            return answer["success"]
        if self is HttpReply.MERGED:
            return {k: v for k, v in answer.items() if k != "success"}
        if self is HttpReply.UPDATE:
            return {k: v for k, v in answer.items() if k != "message"}
        return answer


@dataclass(frozen=True)
class Route:
    """The gateway route `/<op>` that forwards an op with the caller's key: its HTTP method and
    the shape of its answer."""

    method: str
    reply: HttpReply


@dataclass(frozen=True)
class Span:
    """A bound carried by an `Annotated` field: a string's length, or an integer's value, in
    [low, high] (high None: unbounded)."""

    low: int
    high: int | None = None

    def describe(self, unit: str) -> str:
        """The bound in words, e.g. "1 to 256 characters"."""
        return f"{self.low}{'' if self.high is None else f' to {self.high}'}{unit}" + (
            " or more" if self.high is None else ""
        )

    def check(self, name: str, value: Any) -> None:
        size = len(value) if isinstance(value, str) else value
        if size < self.low or (self.high is not None and size > self.high):
            what = "a string of" if isinstance(value, str) else "an integer in"
            top = "" if self.high is None else f" to {self.high}"
            unit = " characters" if isinstance(value, str) else ""
            raise ValueError(f"{name} must be {what} {self.low}{top or ' or more'}{unit}")


TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "map"}


def type_name(hint: Any) -> str:
    """A declared type as errors and docs/protocol.md name it (None, "not sent", left out)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None))
    if origin is list:
        return f"list of {_plural(args[0])}"
    if origin is Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in args)
    return TYPE_NAMES.get(origin or hint, getattr(hint, "__name__", str(hint)))


def _plural(hint: Any) -> str:
    if get_origin(hint) is list:
        return f"lists of {_plural(get_args(hint)[0])}"
    return type_name(hint) + ("" if get_origin(hint) is Literal else "s")


def check_type(name: str, value: Any, hint: Any) -> None:
    """ValueError naming `name` when `value` (decoded msgpack or JSON) is not of type `hint`: a
    str, int (never a bool), float (an int too), bool, Literal, list, optional or Annotated with
    `Span`s of those."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        check_type(name, value, args[0])
        for bound in args[1:]:
            if isinstance(bound, Span):
                bound.check(name, value)
        return
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # an optional field: its own type's error, which says more
            return check_type(name, value, options[0])
        for option in options:
            try:
                return check_type(name, value, option)
            except ValueError:
                continue
    elif origin is list:
        if isinstance(value, list):
            for i, item in enumerate(value):
                check_type(f"{name}[{i}]", item, args[0])
            return
    elif origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return
    elif _is_a(value, hint):
        return
    raise ValueError(f"{name} must be of type {type_name(hint)}")


def _is_a(value: Any, hint: Any) -> bool:
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(hint, type) and isinstance(value, hint)


ControlT = TypeVar("ControlT", bound="ControlOp")
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
NAME = Annotated[str, Span(1, 256)]  # an adapter's, a group's or a weight version's
PATH = Annotated[str, Span(1, 4096)]  # a folder on the runtime's machine


@dataclass(frozen=True)
class ControlOp:
    """A control op's fields, checked (`from_wire`) by the runtime and the router before any
    handler runs: a field not declared is refused by name, a wrong type or bound names its
    field (`invalid_request`, an HTTP 400). Subclasses declare the op in their class statement
    (`op=`, `fleet=`, `reply=`; `admin=False` for any key; `route=` for a gateway route; `waits`)
    and are registered in CONTROL_OPS under it. Its docstring is its line in docs/protocol.md;
    its fields' order is that of the endpoints' methods' positional arguments (docs/rl.md), so
    it never changes."""

    op: ClassVar[str]
    admin: ClassVar[bool]
    fleet: ClassVar[Fleet]
    reply: ClassVar[str]
    route: ClassVar[Route | None]
    # answered once the requests in flight have finished or a trainer has done its part: the
    # runtime answers it later, beside its loop, and callers wait WEIGHT_UPDATE_WAIT_S for it
    waits: ClassVar[bool]
    # the fields of its result (of each item, for a list) that name paths on the server's
    # machine: only the admin sees them (`seen_by`); a tenant never sees a server path
    admin_fields: ClassVar[tuple[str, ...]]

    def __init_subclass__(
        cls,
        *,
        op: str,
        fleet: Fleet,
        reply: str,
        admin: bool = True,
        route: Route | None = None,
        waits: bool = False,
        admin_fields: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if op in CONTROL_OPS:
            raise ValueError(f"two control ops named {op!r}")
        cls.op, cls.fleet, cls.reply, cls.admin, cls.route = op, fleet, reply, admin, route
        cls.waits, cls.admin_fields = waits, admin_fields
        CONTROL_OPS[op] = cls

    @classmethod
    def seen_by(cls, result: Any, admin: bool) -> Any:
        """`result` as its caller may see it: whole by the admin (who names the paths models and
        adapters load from anyway); anyone else gets it without `admin_fields` (in each item of
        a list), so it names models and adapters by their served names only. The runtime and
        the router both apply it: a router may have asked its worker with the admin's key."""
        if admin or not cls.admin_fields:
            return result
        if isinstance(result, list):
            return [cls.seen_by(item, admin) for item in result]
        if isinstance(result, dict):
            return {k: v for k, v in result.items() if k not in cls.admin_fields}
        return result

    @property
    def wait_s(self) -> float | None:
        """How long a caller (the gateway, a router) waits for the answer (None: its default)."""
        return WEIGHT_UPDATE_WAIT_S if self.waits else None

    @classmethod
    def from_wire(cls: type[ControlT], msg: Mapping[str, Any]) -> ControlT:
        """The op a map (a ZeroMQ frame, an HTTP body) sends, every field checked."""
        unknown = sorted(map(str, set(msg) - {"op", "rid"} - {f.name for f in fields(cls)}))
        if unknown:
            raise ValueError(f"unknown {cls.op} fields: {unknown}")
        hints = get_type_hints(cls, include_extras=True)
        values = {}
        for f in fields(cls):
            if f.name in msg:
                check_type(f.name, msg[f.name], hints[f.name])
                values[f.name] = msg[f.name]
            elif f.default is MISSING:
                raise ValueError(f"{cls.op} needs {f.name} ({type_name(hints[f.name])})")
        record = cls(**values)
        record.check()
        return record

    def check(self) -> None:
        """A rule across fields (a ValueError); the fields' own types and bounds are checked
        already."""

    def fields(self) -> dict[str, Any]:
        """The fields set (a field that is None is left out): what a call sends beside the op."""
        sent = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in sent.items() if v is not None}

    def wire(self) -> dict[str, Any]:
        """The op's map as a client sends it."""
        return {"op": self.op, **self.fields()}


CONTROL_OPS: dict[str, type[ControlOp]] = {}
ANSWER = '`{"rid", "result": true}`'
UPDATE_ANSWER = (
    'answered once the requests in flight finished and the weights loaded: `{"rid", "result": '
    '{"success": true, "weight_version", "seconds"}}`, or `invalid_request` naming the refused '
    "field, tensor or shape (the old weights stay). docs/rl.md"
)


@dataclass(frozen=True)
class Health(ControlOp, op="health", admin=False, fleet=Fleet.ROUTER, reply=ANSWER):
    """Whether the runtime serves (a router: whether a worker is alive)."""


@dataclass(frozen=True)
class Ping(
    ControlOp,
    op="ping",
    admin=False,
    fleet=Fleet.ROUTER,
    reply='`{"rid", "result": {"server_id"}}`; see heartbeats below',
):
    """A heartbeat: a client that pings is watched, and told when the server restarts."""


@dataclass(frozen=True)
class Stats(
    ControlOp,
    op="stats",
    admin=False,
    fleet=Fleet.ALL,
    reply='`{"rid", "result": {...}}`: the counters listed below',
):
    """The runtime's counters, a tenant's key seeing its own tenant's only."""


@dataclass(frozen=True)
class Metrics(
    ControlOp,
    op="metrics",
    admin=False,
    fleet=Fleet.ALL,
    reply='`{"rid", "result": text}`',
):
    """The Prometheus exposition of this runtime (docs/metrics.md), the `tenant` rows as `stats`
    shows them to the caller; what the gateway's `/metrics` serves after its own HTTP counts."""


@dataclass(frozen=True)
class ModelInfo(
    ControlOp,
    op="model_info",
    admin=False,
    fleet=Fleet.ONE,
    reply='`{"rid", "result": {...}}`: the fields listed below',
    admin_fields=("model_path", "tokenizer_path"),
):
    """What is served: the model, its tokenizer and template, the pool, the weights' version."""


@dataclass(frozen=True)
class Unpin(
    ControlOp, op="unpin", admin=False, fleet=Fleet.ROUTER, reply='`{"rid", "result": bool}`'
):
    """Release a `pin` of the caller's connection (a router sends it to the pin's worker)."""

    pin_id: Annotated[str, Span(1, MAX_PIN_ID_CHARS)]


@dataclass(frozen=True)
class ListLoraAdapters(
    ControlOp,
    op="list_lora_adapters",
    admin=False,
    fleet=Fleet.ONE,
    reply='`{"rid", "result": [{"name", "path", "rank", "digest"}]}`',
    route=Route("GET", HttpReply.RESULT),
    admin_fields=("path",),
):
    """The adapters loaded."""


@dataclass(frozen=True)
class LoadLoraAdapter(
    ControlOp,
    op="load_lora_adapter",
    fleet=Fleet.ALL,
    reply='`{"rid", "result": {"name", "path", "rank", "digest"}}`, or `invalid_request` with '
    "one line naming why the adapter cannot be served (taken name, rank above "
    "`--max-lora-rank`, a module other than q/k/v/o/gate/up/down, a shape the base model does "
    "not have, DoRA, biases, a server without `--enable-lora`/`--lora-paths`)",
    route=Route("POST", HttpReply.MERGED),
):
    """Load an adapter as `lora_name`: `lora_path` is a folder on the runtime's machine holding
    peft's `adapter_config.json` and `adapter_model.safetensors`."""

    lora_name: NAME
    lora_path: PATH


@dataclass(frozen=True)
class UnloadLoraAdapter(
    ControlOp,
    op="unload_lora_adapter",
    fleet=Fleet.ALL,
    reply=f"{ANSWER}; `invalid_request` while a queued or running request names it",
    route=Route("POST", HttpReply.SUCCESS),
):
    """Unload an adapter no request uses."""

    lora_name: NAME


@dataclass(frozen=True)
class FlushCache(
    ControlOp,
    op="flush_cache",
    fleet=Fleet.ALL,
    reply='`{"rid", "result": bool}` (false while requests run)',
):
    """Forget every cached prefix (the host and disk tiers' too)."""


@dataclass(frozen=True)
class CheckInvariants(
    ControlOp,
    op="check_invariants",
    fleet=Fleet.ALL,
    reply=f"{ANSWER} or an `internal_error` naming the broken invariant",
):
    """Check that every KV slot, request row and lock count is where it belongs (DESIGN.md)."""


@dataclass(frozen=True)
class MemorySnapshot(
    ControlOp,
    op="memory_snapshot",
    fleet=Fleet.ALL,
    reply='`{"rid", "result": {...}}`: `page_size`, `num_pages`, `free_pages`, `nodes` with '
    "`id`, `parent`, `slots`, `lock_ref`; `requests` with `rid`, `last_node`, `tree_slots`, "
    "`own_slots`; `pinned_nodes`; request-table `rows`, `free_rows`, `running_rows`",
):
    """Who holds which KV slot, as plain data, for checkers outside the runtime."""


@dataclass(frozen=True)
class Shutdown(
    ControlOp, op="shutdown", fleet=Fleet.ROUTER, reply=f"{ANSWER}, then the process exits"
):
    """Stop serving (a router stops itself, not its workers)."""


@dataclass(frozen=True)
class UpdateWeightsFromDisk(
    ControlOp,
    op="update_weights_from_disk",
    fleet=Fleet.ALL,
    reply=UPDATE_ANSWER,
    waits=True,
    route=Route("POST", HttpReply.UPDATE),
):
    """Serve the weights of the model folder `model_path` (on the runtime's machine, of the
    served architecture) once the requests in flight finish; `weight_version` names them
    (default: the count of updates); `abort_all_requests` ends what is in flight first."""

    model_path: PATH
    weight_version: NAME | None = None
    abort_all_requests: bool = False
    load_format: Literal["auto", "safetensors"] | None = None


@dataclass(frozen=True)
class UpdateWeightsFromTensor(
    ControlOp,
    op="update_weights_from_tensor",
    fleet=Fleet.ALL,
    reply="as `update_weights_from_disk`",
    waits=True,
):
    """Serve the named tensors `rt.Engine.update_weights_from_tensor` wrote as safetensors to
    the folder `path` (every weight, by its checkpoint name)."""

    path: PATH
    weight_version: NAME | None = None
    abort_all_requests: bool = False


@dataclass(frozen=True)
class InitWeightsUpdateGroup(
    ControlOp,
    op="init_weights_update_group",
    fleet=Fleet.WORKERS_ONLY,
    reply='`{"rid", "result": {"success": true, "message"}}` once the group formed; `timeout` '
    "past `--weights-update-timeout`",
    route=Route("POST", HttpReply.RESULT),
    waits=True,
):
    """Join a trainer's group: rank 0 (the trainer) hosts its store at `master_address`
    (one of `--weights-update-allowed-hosts`): `master_port`; the runtime is rank
    `rank_offset` of `world_size`; gloo only, `--tp-size 1` only."""

    master_address: NAME
    master_port: Annotated[int, Span(0, 65535)]
    rank_offset: Annotated[int, Span(1)]
    world_size: Annotated[int, Span(2)]
    group_name: NAME = DEFAULT_GROUP
    backend: Literal["gloo"] = "gloo"

    def check(self) -> None:
        if self.rank_offset >= self.world_size:
            raise ValueError("rank_offset must be in [1, world_size): the trainer is rank 0")


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(
    ControlOp,
    op="update_weights_from_distributed",
    fleet=Fleet.WORKERS_ONLY,
    reply="receives one broadcast per name from rank 0, then answers as `update_weights_from_disk`",
    route=Route("POST", HttpReply.UPDATE),
    waits=True,
):
    """Serve the tensors `names` (`dtypes`: `float32`, `bfloat16`, ..., a `torch.` prefix
    allowed; `shapes`) that the trainer broadcasts over `group_name`, in that order: every
    weight of the model. New weights always forget the cache (`flush_cache` true only)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: NAME = DEFAULT_GROUP
    weight_version: NAME | None = None
    abort_all_requests: bool = False
    flush_cache: Literal[True] = True


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(
    ControlOp,
    op="destroy_weights_update_group",
    fleet=Fleet.WORKERS_ONLY,
    reply='`{"rid", "result": {"success": true}}`',
    route=Route("POST", HttpReply.RESULT),
):
    """Leave a trainer's group."""

    group_name: NAME = DEFAULT_GROUP


@dataclass(frozen=True)
class PauseGeneration(
    ControlOp,
    op="pause_generation",
    fleet=Fleet.ALL,
    reply=f"{ANSWER}; under `abort` every request in flight answers now with what it has "
    '(`finish_reason.type == "abort"`)',
    route=Route("POST", HttpReply.SUCCESS),
):
    """Stop generating until `continue_generation`: `abort` ends what is in flight, `in_place`
    keeps it with its KV."""

    mode: Literal["abort", "in_place"] = "abort"


@dataclass(frozen=True)
class ContinueGeneration(
    ControlOp,
    op="continue_generation",
    fleet=Fleet.ALL,
    reply=ANSWER,
    route=Route("POST", HttpReply.SUCCESS),
):
    """Generate again after `pause_generation`."""


MEMORY_TAGS = Literal["kv_cache"]  # what release/resume_memory_occupation free and restore


@dataclass(frozen=True)
class ReleaseMemoryOccupation(
    ControlOp,
    op="release_memory_occupation",
    fleet=Fleet.ALL,
    reply=f"{ANSWER}; `invalid_request` while requests are in flight",
    route=Route("POST", HttpReply.SUCCESS),
):
    """Free the KV pool's memory (the weights stay resident); generates queue until
    `resume_memory_occupation`."""

    tags: list[MEMORY_TAGS] | None = None


@dataclass(frozen=True)
class ResumeMemoryOccupation(
    ControlOp,
    op="resume_memory_occupation",
    fleet=Fleet.ALL,
    reply=ANSWER,
    route=Route("POST", HttpReply.SUCCESS),
):
    """Allocate the KV pool again after `release_memory_occupation`."""

    tags: list[MEMORY_TAGS] | None = None


@dataclass(frozen=True)
class GetWeightVersion(
    ControlOp,
    op="get_weight_version",
    admin=False,
    fleet=Fleet.ONE,
    reply='`{"rid", "result": {"weight_version"}}`',
    route=Route("GET", HttpReply.RESULT),
):
    """The weights' version (also in `model_info`, `stats` and every `meta_info`; docs/rl.md)."""


# only the admin key (`--admin-api-key`) may send these; a tenant's key gets `unauthorized`
ADMIN_OPS = frozenset(name for name, record in CONTROL_OPS.items() if record.admin)
# what a client sends with its admin key when it has one: the control ops, and the ops of which
# the admin sees more (`stats`: every tenant; those with `admin_fields`: the server's paths)
ADMIN_KEYED_OPS = ADMIN_OPS | {"stats"} | {n for n, r in CONTROL_OPS.items() if r.admin_fields}
