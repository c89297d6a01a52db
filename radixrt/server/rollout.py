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
from radixrt.protocol import (
    ContinueGeneration,
    ControlOp,
    DestroyWeightsUpdateGroup,
    ErrorCode,
    GetWeightVersion,
    InitWeightsUpdateGroup,
    PauseGeneration,
    ReleaseMemoryOccupation,
    RequestError,
    ResumeMemoryOccupation,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    error_reply,
)

if TYPE_CHECKING:
    from radixrt.server.front import Caller
    from radixrt.server.zmq_server import Server

logger = logging.getLogger(__name__)

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


def update_from_disk(server: Server, caller: Caller, op: UpdateWeightsFromDisk, rid: Any) -> None:
    load = partial(server.scheduler.update_weights, Path(op.model_path).expanduser(), True)
    _request_update(server, caller, op, rid, load)


def update_from_tensor(
    server: Server, caller: Caller, op: UpdateWeightsFromTensor, rid: Any
) -> None:
    load = partial(server.scheduler.update_weights, Path(op.path), False)
    _request_update(server, caller, op, rid, load)


def init_group(server: Server, caller: Caller, op: InitWeightsUpdateGroup, rid: Any) -> None:
    """Join a trainer's group beside the loop, if its address is allowed
    (`--weights-update-allowed-hosts`); answered once the group has formed, or with the error,
    or with `timeout` after `--weights-update-timeout` seconds (`poll_joins`)."""
    address, allowed = op.master_address, server.args.weights_update_allowed_hosts
    if address not in allowed and ANY_HOST not in allowed:
        raise ValueError(
            f"master_address {address!r} is not in --weights-update-allowed-hosts {list(allowed)}"
        )
    spec = WeightsGroupSpec(op.group_name, address, op.master_port, op.rank_offset, op.world_size)
    _check_join(server, spec.name)
    timeout = server.args.weights_update_timeout
    join = partial(server.scheduler.join_weights_group, spec, timeout + TORCH_GRACE_S)
    work = Beside(join, timeout, "join-weights-group")
    server.joins.append(Join(caller.identity, rid, spec, work))


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


def destroy_group(
    server: Server, caller: Caller, op: DestroyWeightsUpdateGroup, rid: Any
) -> dict[str, Any]:
    server.scheduler.leave_weights_group(op.group_name)
    return {"success": True}


def update_from_group(
    server: Server, caller: Caller, op: UpdateWeightsFromDistributed, rid: Any
) -> None:
    """The tensors the trainer broadcasts, received beside the loop from now on (at most
    `--weights-update-timeout` seconds), then served as from disk once the requests in flight
    have finished."""
    specs = Scheduler.tensor_specs(op.names, op.dtypes, op.shapes)
    receive = server.scheduler.weights_receiver(op.group_name, specs)
    _check_update(server, op)
    received = Beside(receive, server.args.weights_update_timeout, "receive-weights")

    def load(version: str | None) -> WeightUpdate:
        return server.scheduler.update_weights_from_tensors(received.result(), version)

    _request_update(server, caller, op, rid, load, received)


Update = UpdateWeightsFromDisk | UpdateWeightsFromTensor | UpdateWeightsFromDistributed


def _check_update(server: Server, op: Update) -> None:
    """Refuse an update while another one waits, or while requests are paused in place (it
    could never run) unless it aborts them."""
    if server.pending_update is not None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "another weight update is waiting")
    busy = len(server.scheduler.in_flight())
    if busy and server.scheduler.paused is not None and not op.abort_all_requests:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"{busy} requests are paused in place: continue_generation first, pause with mode "
            "abort, or pass abort_all_requests",
        )


def _request_update(
    server: Server,
    caller: Caller,
    op: Update,
    rid: Any,
    load: Callable[[str | None], WeightUpdate],
    received: Beside[Any] | None = None,
) -> None:
    """Hold new requests and wait for those in flight, then load (`run_pending_update`)."""
    _check_update(server, op)
    scheduler = server.scheduler
    if op.abort_all_requests:
        server.publish(scheduler.abort_all("aborted for a weight update"))
    version = op.weight_version
    server.pending_update = PendingUpdate(caller.identity, rid, load, version, received)
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


def pause_generation(server: Server, caller: Caller, op: PauseGeneration, rid: Any) -> bool:
    """`Scheduler.pause`. A waiting update runs once `abort` has ended what was in flight;
    paused in place, it could never run: refused."""
    server.publish(server.scheduler.pause(op.mode))
    if op.mode == "in_place" and server.scheduler.in_flight():
        fail_pending_update(
            server,
            ErrorCode.INVALID_REQUEST,
            "generation was paused in place before the update could run",
        )
    run_pending_update(server)
    return True


def continue_generation(server: Server, caller: Caller, op: ContinueGeneration, rid: Any) -> bool:
    server.scheduler.resume()
    return True


def release_memory(server: Server, caller: Caller, op: ReleaseMemoryOccupation, rid: Any) -> bool:
    """Free the KV pool (`Scheduler.release_memory`); generates queue until resumed."""
    server.scheduler.release_memory()
    return True


def resume_memory(server: Server, caller: Caller, op: ResumeMemoryOccupation, rid: Any) -> bool:
    server.scheduler.resume_memory()
    return True


def weight_version(
    server: Server, caller: Caller, op: GetWeightVersion, rid: Any
) -> dict[str, str]:
    return {"weight_version": server.scheduler.weight_version}


# the runtime's handler of each op of this module (zmq_server.CONTROL); those that wait
# (`ControlOp.waits`) answer by themselves, later
HANDLERS: dict[type[ControlOp], Callable[..., Any]] = {
    UpdateWeightsFromDisk: update_from_disk,
    UpdateWeightsFromTensor: update_from_tensor,
    InitWeightsUpdateGroup: init_group,
    UpdateWeightsFromDistributed: update_from_group,
    DestroyWeightsUpdateGroup: destroy_group,
    PauseGeneration: pause_generation,
    ContinueGeneration: continue_generation,
    ReleaseMemoryOccupation: release_memory,
    ResumeMemoryOccupation: resume_memory,
    GetWeightVersion: weight_version,
}
