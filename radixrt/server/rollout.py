"""The ops a reinforcement-learning trainer drives a rollout engine with (SGLang's names; every
one but `get_weight_version` is an admin op): `update_weights_from_disk`,
`update_weights_from_tensor` (the named tensors an `rt.Engine` wrote),
`init_weights_update_group` / `update_weights_from_distributed` / `destroy_weights_update_group`
(a trainer's gloo group broadcasts them), `pause_generation`,
`continue_generation`, `release_memory_occupation`, `resume_memory_occupation`.

New weights never meet a request half-way: an update waits until no request that has started is
in flight (`Scheduler.in_flight`), holding new ones in the queue meanwhile, then loads and
answers; so every output's tokens come from one `weight_version`. With `abort_all_requests`,
or after `pause_generation` in mode `abort`, there is nothing to wait for. docs/rl.md tells the
whole contract.

What waits on a trainer never blocks the serving loop: joining its group and receiving its
broadcasts run on a thread beside the loop (`Beside`), generation going on meanwhile, and are
answered when they finish, fail, or pass `--weights-update-timeout` (`timeout`), whichever comes
first. A group's address must be one of `--weights-update-allowed-hosts` (loopback by default).
Every admin op is answered: a failure the code did not foresee is `internal_error`, never a
silence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from radixrt.engine.scheduler import Scheduler, WeightsGroupSpec, WeightUpdate
from radixrt.protocol import ErrorCode, RequestError, error_reply

if TYPE_CHECKING:
    from radixrt.server.front import Caller
    from radixrt.server.zmq_server import Server

logger = logging.getLogger(__name__)

MAX_VERSION_CHARS = 256
UPDATE_FIELDS = frozenset({"op", "rid", "abort_all_requests", "weight_version"})
DISK_FIELDS = UPDATE_FIELDS | {"model_path", "load_format"}
TENSOR_FIELDS = UPDATE_FIELDS | {"path"}
DISTRIBUTED_FIELDS = UPDATE_FIELDS | {"names", "dtypes", "shapes", "group_name", "flush_cache"}
GROUP_FIELDS = frozenset(
    {
        "op",
        "rid",
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    }
)
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
LOAD_FORMATS = (None, "auto", "safetensors")
MEMORY_TAGS = ("kv_cache",)  # what release/resume_memory_occupation free and restore
# joins answered at their deadline whose threads have not ended (a peer that never speaks can
# hold one for ever): past this many, a new join is refused (`overloaded`)
MAX_STUCK_JOINS = 4
ANY_HOST = "*"  # in --weights-update-allowed-hosts: every address
# torch's own waits get this much longer than the loop's deadline, so a trainer that does not
# answer is told `timeout` by the loop, the same way whichever wait it stalls in
TORCH_GRACE_S = 1.0

T = TypeVar("T")


class Beside(Generic[T]):
    """`work` running on a thread beside the serving loop, due `timeout` seconds from now; the
    loop polls it (`done`, `expired`) and takes its `result` (which raises what `work` raised).
    A daemon thread: one stuck in torch past its deadline must not hold the process at exit."""

    def __init__(self, work: Callable[[], T], timeout: float, name: str):
        self.future: Future[T] = Future()
        self.deadline = time.monotonic() + timeout
        threading.Thread(target=self._run, args=(work,), name=name, daemon=True).start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self.future.set_result(work())
        except BaseException as e:  # handed to the loop, which answers with it
            self.future.set_exception(e)

    def done(self) -> bool:
        return self.future.done()

    def expired(self) -> bool:
        return not self.future.done() and time.monotonic() > self.deadline

    def result(self) -> T:
        return self.future.result(timeout=0)


@dataclass
class Join:
    """An `init_weights_update_group` being joined beside the loop, and whom it answers
    (`answered` once it has, at its deadline: the thread may still be stuck)."""

    identity: bytes
    rid: Any
    spec: WeightsGroupSpec
    work: Beside[object]
    answered: bool = False


@dataclass(frozen=True)
class PendingUpdate:
    """An update waiting for the requests in flight to finish (and for what it `received`
    beside the loop, if anything), and whom it answers; `load` runs it (a `Scheduler` update
    with its source bound) given the version asked for."""

    identity: bytes
    rid: Any
    load: Callable[[str | None], WeightUpdate]
    version: str | None
    received: Beside[Any] | None = field(default=None)  # what `load` waits for (a trainer's)


def check_fields(msg: dict[str, Any], allowed: frozenset[str]) -> None:
    """ValueError naming the fields of `msg` its op does not take."""
    unknown = sorted(map(str, set(msg) - allowed))
    if unknown:
        raise ValueError(f"unknown {msg.get('op')} fields: {unknown}")


def update_from_disk(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """`model_path`: a model folder on the runtime's machine, of the served architecture."""
    check_fields(msg, DISK_FIELDS)
    path = msg.get("model_path")
    if not isinstance(path, str) or not path:
        raise ValueError("update_weights_from_disk needs a string model_path")
    if msg.get("load_format") not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}")
    load = partial(server.scheduler.update_weights, Path(path).expanduser(), True)
    _request_update(server, caller, msg, load)


def update_from_tensor(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """`path`: the folder of safetensors an `rt.Engine` wrote its named tensors to (every
    weight of the model, by its checkpoint name)."""
    check_fields(msg, TENSOR_FIELDS)
    path = msg.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError("update_weights_from_tensor needs a string path")
    _request_update(
        server, caller, msg, partial(server.scheduler.update_weights, Path(path), False)
    )


def init_group(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """Join a trainer's group (SGLang's `init_weights_update_group`): at `master_address`:
    `master_port`, as rank `rank_offset` of `world_size` (the trainer is rank 0), under
    `group_name`; gloo only. The address must be allowed (`--weights-update-allowed-hosts`).
    Joined beside the loop; answered once the group has formed, or with the error, or with
    `timeout` after `--weights-update-timeout` seconds (`poll_joins`)."""
    check_fields(msg, GROUP_FIELDS)
    address, port = msg.get("master_address"), msg.get("master_port")
    rank, size = msg.get("rank_offset"), msg.get("world_size")
    if not isinstance(address, str) or not all(_count(v) for v in (port, rank, size)):
        raise ValueError(
            "init_weights_update_group needs a string master_address and ints master_port, "
            "rank_offset and world_size"
        )
    if not 0 < rank < size:
        raise ValueError("rank_offset must be in [1, world_size): the trainer is rank 0")
    if msg.get("backend", "gloo") != "gloo":
        raise ValueError("backend must be gloo (the CPU's; nccl is not built)")
    allowed = server.args.weights_update_allowed_hosts
    if address not in allowed and ANY_HOST not in allowed:
        raise ValueError(
            f"master_address {address!r} is not in --weights-update-allowed-hosts {list(allowed)}"
        )
    spec = WeightsGroupSpec(_group_name(msg), address, port, rank, size)
    _check_join(server, spec.name)
    timeout = server.args.weights_update_timeout
    join = partial(server.scheduler.join_weights_group, spec, timeout + TORCH_GRACE_S)
    work = Beside(join, timeout, "join-weights-group")
    server.joins.append(Join(caller.identity, msg.get("rid"), spec, work))


def _check_join(server: Server, name: str) -> None:
    """Refuse a join the runtime cannot take now: one of that name joined or joining, or too
    many earlier joins still stuck past their deadlines."""
    server.scheduler.check_weights_group(name)
    if any(j.spec.name == name and not j.answered for j in server.joins):
        raise ValueError(f"this runtime is joining a group named {name!r} already")
    stuck = sum(j.answered for j in server.joins)
    if stuck >= MAX_STUCK_JOINS:
        raise RequestError(
            ErrorCode.OVERLOADED, f"{stuck} earlier joins are still stuck past their timeouts"
        )


def poll_joins(server: Server) -> None:
    """Answer each join that finished (the group kept) or failed, and each past its deadline
    (`timeout`; a group its thread forms later is dropped, never kept)."""
    for join in list(server.joins):
        if join.work.done():
            server.joins.remove(join)
            if not join.answered:
                server.reply(join.identity, _join_reply(server, join))
        elif join.work.expired() and not join.answered:
            join.answered = True
            server.reply(
                join.identity,
                error_reply(
                    join.rid,
                    ErrorCode.TIMEOUT,
                    f"the group at {join.spec.address}:{join.spec.port} did not form within "
                    f"{server.args.weights_update_timeout:g} s",
                ),
            )


def _join_reply(server: Server, join: Join) -> dict[str, Any]:
    spec = join.spec
    try:
        server.scheduler.add_weights_group(spec.name, join.work.result())
    except Exception as e:
        return _failure(join.rid, e, f"joining group {spec.name!r}")
    message = f"joined group {spec.name!r} as rank {spec.rank} of {spec.world_size}"
    return {"rid": join.rid, "result": {"success": True, "message": message}}


def _failure(rid: Any, error: Exception, what: str) -> dict[str, Any]:
    """The answer to an admin op that failed: its code by the error's kind (a trainer that did
    not answer in time: `timeout`; what the op asked that cannot be done: `invalid_request`),
    any other failure logged and answered `internal_error`."""
    if isinstance(error, RequestError):
        return error_reply(rid, error.code, str(error))
    if isinstance(error, TimeoutError):
        return error_reply(rid, ErrorCode.TIMEOUT, str(error))
    if isinstance(error, (ValueError, ConnectionError)):
        return error_reply(rid, ErrorCode.INVALID_REQUEST, str(error))
    logger.exception("%s failed", what, exc_info=error)
    return error_reply(rid, ErrorCode.INTERNAL_ERROR, f"{what}: {type(error).__name__}: {error}")


def destroy_group(server: Server, caller: Caller, msg: dict[str, Any]) -> dict[str, Any]:
    check_fields(msg, frozenset({"op", "rid", "group_name"}))
    server.scheduler.leave_weights_group(_group_name(msg))
    return {"success": True}


def update_from_group(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """SGLang's `update_weights_from_distributed`: the tensors `names` (`dtypes`, `shapes`)
    that the trainer broadcasts over `group_name`, in that order, received beside the loop
    from now on (at most `--weights-update-timeout` seconds), then served as from disk once
    the requests in flight have finished."""
    check_fields(msg, DISTRIBUTED_FIELDS)
    if msg.get("flush_cache", True) is not True:
        raise ValueError("flush_cache must be true: new weights always forget the cache")
    specs = Scheduler.tensor_specs(msg.get("names"), msg.get("dtypes"), msg.get("shapes"))
    receive = server.scheduler.weights_receiver(_group_name(msg), specs)
    _check_update(server, msg)
    received = Beside(receive, server.args.weights_update_timeout, "receive-weights")

    def load(version: str | None) -> WeightUpdate:
        return server.scheduler.update_weights_from_tensors(received.result(), version)

    _request_update(server, caller, msg, load, received)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _group_name(msg: dict[str, Any]) -> str:
    name = msg.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_VERSION_CHARS:
        raise ValueError(f"group_name must be a string of 1 to {MAX_VERSION_CHARS} characters")
    return name


def _check_update(server: Server, msg: dict[str, Any]) -> None:
    """Refuse an update whose fields are wrong, while another one waits, or while requests
    are paused in place (it could never run) unless it aborts them."""
    version, abort = msg.get("weight_version"), msg.get("abort_all_requests", False)
    if version is not None and (
        not isinstance(version, str) or not 0 < len(version) <= MAX_VERSION_CHARS
    ):
        raise ValueError(f"weight_version must be a string of 1 to {MAX_VERSION_CHARS} characters")
    if not isinstance(abort, bool):
        raise ValueError("abort_all_requests must be true or false")
    if server.pending_update is not None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "another weight update is waiting")
    busy = len(server.scheduler.in_flight())
    if busy and server.scheduler.paused is not None and not abort:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"{busy} requests are paused in place: continue_generation first, pause with mode "
            "abort, or pass abort_all_requests",
        )


def _request_update(
    server: Server,
    caller: Caller,
    msg: dict[str, Any],
    load: Callable[[str | None], WeightUpdate],
    received: Beside[Any] | None = None,
) -> None:
    """Hold new requests and wait for those in flight, then load (`run_pending_update`)."""
    _check_update(server, msg)
    scheduler = server.scheduler
    if msg.get("abort_all_requests", False):
        server.publish(scheduler.abort_all("aborted for a weight update"))
    version = msg.get("weight_version")
    server.pending_update = PendingUpdate(caller.identity, msg.get("rid"), load, version, received)
    scheduler.holding = True
    run_pending_update(server)


def run_pending_update(server: Server) -> None:
    """Load the waiting update once what it receives has come and nothing is in flight, and
    answer it: the version served and the seconds the load took, or the error (the old weights
    kept; `timeout` when what it receives is past its deadline)."""
    update, scheduler = server.pending_update, server.scheduler
    if update is None:
        return
    if update.received is not None and not update.received.done():
        if update.received.expired():
            timeout = server.args.weights_update_timeout
            fail_pending_update(
                server,
                ErrorCode.TIMEOUT,
                f"the trainer's tensors did not all come within {timeout:g} s; the group is "
                "out of step: destroy it and join again",
            )
        return
    if scheduler.in_flight():
        return
    server.pending_update, scheduler.holding = None, False
    try:
        done = update.load(update.version)
        reply = {"rid": update.rid, "result": {"success": True, **asdict(done)}}
    except Exception as e:
        reply = _failure(update.rid, e, "a weight update")
    server.reply(update.identity, reply)


def fail_pending_update(server: Server, code: ErrorCode, message: str) -> None:
    """Answer a waiting update with `code` and stop holding the queue for it."""
    update = server.pending_update
    if update is not None:
        server.pending_update, server.scheduler.holding = None, False
        server.reply(update.identity, error_reply(update.rid, code, message))


def pause_generation(server: Server, caller: Caller, msg: dict[str, Any]) -> bool:
    """`mode` `abort` (the default) or `in_place` (`Scheduler.pause`). A waiting update runs
    once `abort` has ended what was in flight; paused in place, it could never run: refused."""
    check_fields(msg, frozenset({"op", "rid", "mode"}))
    mode = msg.get("mode", "abort")
    server.publish(server.scheduler.pause(mode))
    if mode == "in_place" and server.scheduler.in_flight():
        fail_pending_update(
            server,
            ErrorCode.INVALID_REQUEST,
            "generation was paused in place before the update could run",
        )
    run_pending_update(server)
    return True


def continue_generation(server: Server, caller: Caller, msg: dict[str, Any]) -> bool:
    check_fields(msg, frozenset({"op", "rid"}))
    server.scheduler.resume()
    return True


def _check_tags(msg: dict[str, Any]) -> None:
    check_fields(msg, frozenset({"op", "rid", "tags"}))
    tags = msg.get("tags")
    if tags is not None and (not isinstance(tags, list) or set(tags) - set(MEMORY_TAGS)):
        raise ValueError(f"tags may name only {list(MEMORY_TAGS)} (the weights stay resident)")


def release_memory(server: Server, caller: Caller, msg: dict[str, Any]) -> bool:
    """Free the KV pool (`Scheduler.release_memory`); generates queue until resumed."""
    _check_tags(msg)
    server.scheduler.release_memory()
    return True


def resume_memory(server: Server, caller: Caller, msg: dict[str, Any]) -> bool:
    _check_tags(msg)
    server.scheduler.resume_memory()
    return True


def weight_version(server: Server, caller: Caller, msg: dict[str, Any]) -> dict[str, str]:
    return {"weight_version": server.scheduler.weight_version}
