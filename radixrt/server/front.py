"""The client-facing half that the runtime (`zmq_server.Server`) and the router share.

`ClientFront` owns the ROUTER socket clients connect to and everything done to a frame before an
op handler sees it, in this order:
1. ZeroMQ refuses a frame above `--max-frame-bytes` (ZMQ_MAXMSGSIZE: the sender is dropped
   before the frame is allocated) and, with `--curve-client-keys`, any CURVE key not listed
   (checked through ZAP). One loop turn reads at most FRAMES_PER_TURN frames (BYTES_PER_TURN
   bytes), so a flood delays the next step by a bounded amount, never indefinitely.
2. The frame's `api_key` (and `rid`) is read without building the rest (msgpack's `skip`; a key
   that is not a string ends the scan), so a stranger's frame costs no memory beyond its bytes;
   a missing or wrong key gets `unauthorized`, at most REFUSALS_PER_S a second per peer.
3. The frame is decoded with msgpack size limits on strings and containers, and nesting at most
   `protocol.MAX_NESTING` deep.
4. The op is looked up in the op table (`Op`: handler + role); a control op (`Role.ADMIN`) sent
   with a tenant's key gets `unauthorized`.
5. The handler runs; what it raises costs that one message, never the loop. A control op's
   result is what the caller may see of it (`ControlOp.seen_by`: no server path but to the
   admin). A reply echoes the rid only when it is a short string or an int (`wire_rid`), and
   `reply` never raises for what a message holds.
It also tracks the heartbeats of pinging clients, so a vanished client's work can be ended.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from radixrt.config import FrontSettings, KeySettings
from radixrt.logs import LogThrottle
from radixrt.protocol import (
    ControlOp,
    ErrorCode,
    RequestError,
    decode_map,
    error_reply,
    internal_error_text,
    tenant_label,
    wire_rid,
)
from radixrt.server.exposure import bind_client_socket, check_exposure
from radixrt.server.tenants import TENANT_VISIBLE_STATS, KeyRing, Principal

logger = logging.getLogger(__name__)

CLIENT_SILENCE_S = 5.0  # a pinging client silent this long has vanished (clients ping every second)
# A client with work here is probed this often: a frame to a peer whose connection is gone fails
# at once (ROUTER_MANDATORY), so a killed client is noticed within this, not CLIENT_SILENCE_S.
PROBE_S = 0.5
PROBE = {"rid": "probe"}  # clients ignore a reply to a rid they never sent
MIN_CONTAINER_LEN = 1024  # arrays and maps may be this much longer than the longest prompt
# One loop turn handles at most this many client frames, or bytes, before the loop steps again.
FRAMES_PER_TURN = 256
BYTES_PER_TURN = 64 << 20
# Refusals (a bad key, an unreadable frame) answered per peer: a burst, then this many a second;
# past that they are dropped unanswered. At most MAX_PEERS peers are remembered.
REFUSALS_PER_S = 20.0
REFUSAL_BURST = 40
MAX_PEERS = 4096
# what the key scan may build: a key, an api_key or a rid; nothing else of the frame is built
SCAN_LIMITS = {
    "max_str_len": 4096,
    "max_bin_len": 4096,
    "max_array_len": 64,
    "max_map_len": 64,
    "max_ext_len": 0,
}


class Role(str, Enum):
    """Who may send an op: any accepted key (`client`), or only the admin key (`admin`)."""

    CLIENT = "client"
    ADMIN = "admin"


@dataclass(frozen=True)
class Caller:
    """The sender of one message: its socket identity, who its key names, and that key as it
    was sent (the router forwards it to the workers, see docs/protocol.md)."""

    identity: bytes
    principal: Principal
    api_key: str | None


@dataclass(frozen=True)
class Op:
    """One entry of an op table: `run(caller, msg)`, or for a control op (`record`, whose
    declaration says who may send it) `run(caller, the op as checked by record.from_wire, rid)`.
    With `answers`, the front replies `{"rid", "result": run(...)}`; without, `run` replies
    itself (a generate streams, a fanned-out op answers later)."""

    run: Callable[..., Any]
    record: type[ControlOp] | None = None
    answers: bool = True

    @property
    def role(self) -> Role:
        return Role.ADMIN if self.record is not None and self.record.admin else Role.CLIENT


@dataclass(frozen=True, kw_only=True)
class FrontConfig(KeySettings, FrontSettings):
    """What the client-facing socket needs: its keys and limits, the groups `ServerArgs` and
    `RouterArgs` share (`FrontConfig.of(args)`)."""

    def check(self) -> None:
        # checked here, not in ServerArgs: the secret may arrive by environment after parsing
        if self.curve_client_keys and not self.curve_secret_key:
            raise ValueError("--curve-client-keys needs --curve-secret-key (the server's key)")

    @property
    def keyed(self) -> bool:
        return bool(self.api_key or self.api_key_file or self.admin_api_key)

    def check_exposure(self, host: str) -> None:
        check_exposure(host, self.keyed, self.curve_secret_key, self.curve_client_keys)

    def decode_limits(self) -> dict[str, int]:
        """msgpack limits of an accepted frame: strings up to the frame, containers a little
        longer than the longest prompt of token ids (4 bytes each: a prompt just over it gets
        the prompt-size error), so nothing decodes far past what a request may hold."""
        containers = self.max_prompt_bytes // 4 + MIN_CONTAINER_LEN
        return {
            "max_str_len": self.max_frame_bytes,
            "max_bin_len": self.max_frame_bytes,
            "max_array_len": containers,
            "max_map_len": containers,
            "max_ext_len": 0,
        }


@dataclass(frozen=True)
class Envelope:
    """What is read of a frame before it is decoded: its `api_key` and `rid`."""

    api_key: Any = None
    rid: Any = None


def read_envelope(payload: bytes) -> Envelope:
    """The frame's `api_key` and `rid`, every other value skipped unbuilt. Only a key, a string
    `api_key` and a scalar `rid` (a string or an int) are ever built, each within SCAN_LIMITS; an
    `api_key` or `rid` of another type is skipped and read as None. A ValueError when the frame
    is not a msgpack map, a key is not a string, or a value is outsized or nests too deep."""
    unpacker = msgpack.Unpacker(raw=False, **SCAN_LIMITS)
    unpacker.feed(payload)
    try:
        entries = unpacker.read_map_header()
        found: dict[str, Any] = {}
        for _ in range(entries):
            if _kind_at(payload, unpacker.tell()) != "str":
                raise ValueError("a key is not a string")
            key = unpacker.unpack()
            if (
                ENVELOPE_KINDS.get(key, ())
                and _kind_at(payload, unpacker.tell()) in ENVELOPE_KINDS[key]
            ):
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception as e:  # msgpack raises several types for malformed input
        raise ValueError(f"a message must be one msgpack map ({type(e).__name__}: {e})") from e
    return Envelope(found.get("api_key"), found.get("rid"))


# what the key scan builds of each envelope field, by msgpack type
ENVELOPE_KINDS = {"api_key": ("str",), "rid": ("str", "int")}


def _kind_at(payload: bytes, at: int) -> str:
    """The msgpack type of the value that starts at byte `at`: "str", "int" or "other"."""
    head = payload[at]
    if 0xA0 <= head <= 0xBF or 0xD9 <= head <= 0xDB:
        return "str"
    if head <= 0x7F or head >= 0xE0 or 0xCC <= head <= 0xD3:
        return "int"
    return "other"


def load_curve_keys(path: str | Path) -> set[bytes]:
    """Z85 CURVE public keys, one a line (blank lines and `#` comments skipped)."""
    keys = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _is_curve_key(line):
            raise ValueError(f"{path}:{number}: expected a Z85 CURVE public key (40 characters)")
        keys.add(line.encode())
    if not keys:
        raise ValueError(f"{path}: no CURVE public key")
    return keys


def _is_curve_key(text: str) -> bool:
    try:
        return len(text) == 40 and len(z85.decode(text)) == 32
    except Exception:  # z85 raises several types for characters outside its alphabet
        return False


class CurveAllowlist:
    """The ZAP credentials provider of `--curve-client-keys`: a listed key connects, no other."""

    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self.keys:
            logger.warning("refused a CURVE client key not in --curve-client-keys: %s", key)
        return key in self.keys


def start_allowlist(ctx: zmq.Context[zmq.Socket[bytes]], path: str) -> ThreadAuthenticator:
    """A ZAP handler on `ctx` that admits only the CURVE keys listed in `path`."""
    auth = ThreadAuthenticator(ctx, log=logger)
    auth.start()
    auth.configure_curve_callback("*", CurveAllowlist(load_curve_keys(path)))
    return auth


def check_prompt_size(msg: dict[str, Any], max_bytes: int) -> None:
    """Refuse, before it is tokenized, a prompt above `--max-prompt-bytes`: its text in UTF-8
    bytes, or its input_ids at 4 bytes each."""
    text, ids = msg.get("text"), msg.get("input_ids")
    if isinstance(text, str) and len(text) * 4 > max_bytes:
        size = len(text.encode("utf-8", "surrogatepass"))
    elif isinstance(ids, list):
        size = 4 * len(ids)
    else:
        return
    if size > max_bytes:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"the prompt is {size} bytes; at most {max_bytes} (--max-prompt-bytes)",
        )


def visible_stats(stats: dict[str, Any], principal: Principal) -> dict[str, Any]:
    """`stats` as `principal` may see them: the admin sees everything; a tenant its own row of
    `tenants` and the fields of TENANT_VISIBLE_STATS, at the top and in each worker's (the
    router's `workers`)."""
    if principal.admin:
        return stats
    mine = tenant_label(principal.tenant)
    out = {k: v for k, v in stats.items() if k in TENANT_VISIBLE_STATS}
    if isinstance(stats.get("tenants"), dict):
        out["tenants"] = {k: v for k, v in stats["tenants"].items() if k == mine}
    if isinstance(stats.get("workers"), list):
        out["workers"] = [visible_stats(w, principal) for w in stats["workers"]]
    return out


class PeerBudget:
    """A token bucket per peer identity (`rate` a second, up to `burst`), remembering at most
    MAX_PEERS peers, the least recently seen forgotten first."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # tokens, when

    def take(self, peer: bytes) -> bool:
        """Spend one token of `peer`'s; False when it has none left."""
        now = time.monotonic()
        tokens, then = self.buckets.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        self.buckets[peer] = (tokens - 1 if tokens >= 1 else tokens, now)
        if len(self.buckets) > MAX_PEERS:
            self.buckets.popitem(last=False)
        return tokens >= 1


class ClientFront:
    """The ROUTER socket, frame limits, key ring, heartbeats and op table of one listening
    process (see the module docstring for what happens to a frame, in which order)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        config: FrontConfig,
        ops: dict[str, Op],
    ):
        self.config = config
        self.keys = KeyRing.from_settings(config.api_key, config.api_key_file, config.admin_api_key)
        self.limits = config.decode_limits()
        self.ops = ops
        self.heartbeats: dict[bytes, float] = {}  # last message time of clients that ping
        self.probed: dict[bytes, float] = {}  # when each client with work was last probed
        self.unreachable: set[bytes] = set()  # peers a reply could not be routed to
        self.refusals = PeerBudget(REFUSALS_PER_S, REFUSAL_BURST)
        self.faults = LogThrottle(logger)
        self.auth = (
            start_allowlist(ctx, config.curve_client_keys) if config.curve_client_keys else None
        )
        self.sock = bind_client_socket(
            ctx, endpoint, config.curve_secret_key, config.max_frame_bytes
        )

    def drain(self, timeout_ms: int = 0) -> None:
        """Handle the frames that arrive within `timeout_ms`, then those already there, up to
        FRAMES_PER_TURN frames or BYTES_PER_TURN bytes: the rest wait for the next turn (the
        socket stays readable), so no flood keeps the loop from stepping. A frame that makes
        handling raise costs that frame alone."""
        frames_left, bytes_left = FRAMES_PER_TURN, BYTES_PER_TURN
        while frames_left > 0 and bytes_left > 0 and self.sock.poll(timeout_ms):
            timeout_ms = 0
            frames = self.sock.recv_multipart()
            frames_left -= 1
            bytes_left -= sum(map(len, frames))
            if len(frames) != 2:
                self.faults.note("dropped a message of other than one frame (expected one map)")
                continue
            try:
                self.handle(*frames)
            except Exception as e:  # a bug reached by a frame's content: never the loop's end
                self.faults.note(f"a frame could not be handled: {type(e).__name__}: {e}")

    def handle(self, identity: bytes, payload: bytes) -> None:
        """Authenticate, decode, authorize and run one frame; every failure is its sender's."""
        try:
            envelope = read_envelope(payload)
        except ValueError as e:
            self.refuse(identity, error_reply(None, ErrorCode.INVALID_REQUEST, str(e)))
            return
        principal = self.keys.principal_of(envelope.api_key)
        if principal is None:
            self.refuse(
                identity,
                error_reply(envelope.rid, ErrorCode.UNAUTHORIZED, "missing or wrong api_key"),
            )
            return
        msg, error = decode_map(payload, self.limits)
        if error is not None:
            self.reply(identity, {**error, "rid": envelope.rid})
            return
        assert msg is not None  # decode_map gives one of the two
        api_key = msg.pop("api_key", None)
        self.dispatch(Caller(identity, principal, api_key), msg)

    def dispatch(self, caller: Caller, msg: dict[str, Any]) -> None:
        rid, op_name = msg.get("rid"), msg.get("op")
        if caller.identity in self.heartbeats or op_name == "ping":
            self.heartbeats[caller.identity] = time.monotonic()
        op = self.ops.get(op_name) if isinstance(op_name, str) else None
        if op is None:
            self.reply(
                caller.identity,
                error_reply(rid, ErrorCode.INVALID_REQUEST, f"unknown op {op_name!r}"),
            )
            return
        if op.role is Role.ADMIN and not caller.principal.admin:
            self.reply(
                caller.identity,
                error_reply(
                    rid,
                    ErrorCode.UNAUTHORIZED,
                    f"{op_name} is a control op: it needs the admin key (--admin-api-key)",
                ),
            )
            return
        self._run(op, caller, msg)

    def _run(self, op: Op, caller: Caller, msg: dict[str, Any]) -> None:
        rid = wire_rid(msg.get("rid"))
        try:
            if op.record is None:
                result = op.run(caller, msg)
            else:
                result = op.run(caller, op.record.from_wire(msg), rid)
                result = op.record.seen_by(result, caller.principal.admin)
            if op.answers:
                self.reply(caller.identity, {"rid": rid, "result": result})
        except RequestError as e:
            self.reply(caller.identity, error_reply(rid, e.code, str(e)))
        except ValueError as e:
            self.reply(caller.identity, error_reply(rid, ErrorCode.INVALID_REQUEST, str(e)))
        except AssertionError as e:  # check_invariants found a broken invariant: a bug
            # a traceback names the server's files: the admin's to read, the log's otherwise
            if caller.principal.admin:
                where = traceback.format_exc()
            else:
                logger.exception("op %r failed a check", msg.get("op"))
                where = "an internal check failed (the server's log has where)"
            self.reply(caller.identity, error_reply(rid, ErrorCode.INTERNAL_ERROR, str(e) or where))
        except Exception as e:  # a bug must cost one request, not the server
            logger.exception("op %r failed", msg.get("op"))
            text = f"{type(e).__name__}: {e}" if caller.principal.admin else internal_error_text(e)
            self.reply(caller.identity, error_reply(rid, ErrorCode.INTERNAL_ERROR, text))

    def vanished(self, holders: AbstractSet[bytes] = frozenset()) -> set[bytes]:
        """Clients that are gone, each reported once: those whose connection dropped (a reply or
        a probe could not be routed to them; `holders`, the clients with work here, are probed
        every PROBE_S), and those that pinged and then fell silent for CLIENT_SILENCE_S (hung,
        unplugged without a reset)."""
        now = time.monotonic()
        for identity in holders | set(self.heartbeats):
            if now - self.probed.get(identity, 0.0) >= PROBE_S:
                self.probed[identity] = now
                self.reply(identity, PROBE)
        gone = {i for i, seen in self.heartbeats.items() if now - seen > CLIENT_SILENCE_S}
        gone |= self.unreachable
        self.unreachable = set()
        for identity in gone:
            self.heartbeats.pop(identity, None)
        for identity in [i for i in self.probed if i in gone or i not in holders]:
            del self.probed[identity]
        return gone

    def refuse(self, identity: bytes, msg: dict[str, Any]) -> None:
        """Answer a frame refused before its key was accepted, while its sender is within
        REFUSALS_PER_S; past that its refusals are dropped unanswered (counted), so a keyless
        flood costs a scan per frame and no replies."""
        if self.refusals.take(identity):
            self.reply(identity, msg)
        else:
            self.faults.note(f"refusals to {identity.hex()} past {REFUSALS_PER_S}/s dropped")

    def reply(self, identity: bytes, msg: dict[str, Any]) -> None:
        """Send `msg`; never raises for its content: a map msgpack cannot pack is answered with
        `internal_error` under its (sanitized) rid instead."""
        try:
            frame = msgpack.packb(msg, use_bin_type=True)
        except Exception as e:  # a value msgpack refuses (an int past 64 bits, a deep nest)
            self.faults.note(f"a reply could not be packed: {type(e).__name__}: {e}")
            problem = f"the reply could not be encoded ({type(e).__name__})"
            frame = msgpack.packb(
                error_reply(msg.get("rid"), ErrorCode.INTERNAL_ERROR, problem), use_bin_type=True
            )
        try:
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("client %s is not reading; dropped a reply", identity.hex())
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.unreachable.add(identity)  # its connection is gone: `vanished` says so

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger=linger)
        if self.auth is not None:
            self.auth.stop()
