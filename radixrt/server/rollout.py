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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class PendingUpdate:
    """An update waiting for the requests in flight to finish, and whom it answers; `load`
    runs it (a `Scheduler` update with its source bound) given the version asked for."""

    identity: bytes
    rid: Any
    load: Callable[[str | None], WeightUpdate]
    version: str | None


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


def init_group(server: Server, caller: Caller, msg: dict[str, Any]) -> dict[str, Any]:
    """Join a trainer's group (SGLang's `init_weights_update_group`): at `master_address`:
    `master_port`, as rank `rank_offset` of `world_size` (the trainer is rank 0), under
    `group_name`; gloo only. Answered once the group has formed (the loop waits for it)."""
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
    name = _group_name(msg)
    server.scheduler.join_weights_group(WeightsGroupSpec(name, address, port, rank, size))
    return {"success": True, "message": f"joined group {name!r} as rank {rank} of {size}"}


def destroy_group(server: Server, caller: Caller, msg: dict[str, Any]) -> dict[str, Any]:
    check_fields(msg, frozenset({"op", "rid", "group_name"}))
    server.scheduler.leave_weights_group(_group_name(msg))
    return {"success": True}


def update_from_group(server: Server, caller: Caller, msg: dict[str, Any]) -> None:
    """SGLang's `update_weights_from_distributed`: the tensors `names` (`dtypes`, `shapes`)
    that the trainer broadcasts over `group_name`, in that order, received once the requests
    in flight finished (the trainer's broadcasts wait for it), then served as from disk."""
    check_fields(msg, DISTRIBUTED_FIELDS)
    if msg.get("flush_cache", True) is not True:
        raise ValueError("flush_cache must be true: new weights always forget the cache")
    specs = Scheduler.tensor_specs(msg.get("names"), msg.get("dtypes"), msg.get("shapes"))
    load = partial(server.scheduler.update_weights_from_group, _group_name(msg), specs)
    _request_update(server, caller, msg, load)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _group_name(msg: dict[str, Any]) -> str:
    name = msg.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_VERSION_CHARS:
        raise ValueError(f"group_name must be a string of 1 to {MAX_VERSION_CHARS} characters")
    return name


def _request_update(
    server: Server, caller: Caller, msg: dict[str, Any], load: Callable[[str | None], WeightUpdate]
) -> None:
    version, abort = msg.get("weight_version"), msg.get("abort_all_requests", False)
    if version is not None and (
        not isinstance(version, str) or not 0 < len(version) <= MAX_VERSION_CHARS
    ):
        raise ValueError(f"weight_version must be a string of 1 to {MAX_VERSION_CHARS} characters")
    if not isinstance(abort, bool):
        raise ValueError("abort_all_requests must be true or false")
    scheduler = server.scheduler
    if server.pending_update is not None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "another weight update is waiting")
    if abort:
        server._publish(scheduler.abort_all("aborted for a weight update"))
    busy = len(scheduler.in_flight())
    if busy and scheduler.paused is not None:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"{busy} requests are paused in place: continue_generation first, pause with mode "
            "abort, or pass abort_all_requests",
        )
    server.pending_update = PendingUpdate(caller.identity, msg.get("rid"), load, version)
    scheduler.holding = True
    run_pending_update(server)


def run_pending_update(server: Server) -> None:
    """Load the waiting update once nothing is in flight, and answer it: the version served
    and the seconds the load took, or the error (the old weights kept)."""
    update, scheduler = server.pending_update, server.scheduler
    if update is None or scheduler.in_flight():
        return
    server.pending_update, scheduler.holding = None, False
    try:
        done = update.load(update.version)
        reply = {"rid": update.rid, "result": {"success": True, **asdict(done)}}
    except RequestError as e:
        reply = error_reply(update.rid, e.code, str(e))
    except ValueError as e:
        reply = error_reply(update.rid, ErrorCode.INVALID_REQUEST, str(e))
    server._send(update.identity, reply)


def fail_pending_update(server: Server, message: str) -> None:
    """Answer a waiting update with `invalid_request` and stop holding the queue for it."""
    update = server.pending_update
    if update is not None:
        server.pending_update, server.scheduler.holding = None, False
        server._send(update.identity, error_reply(update.rid, ErrorCode.INVALID_REQUEST, message))


def pause_generation(server: Server, caller: Caller, msg: dict[str, Any]) -> bool:
    """`mode` `abort` (the default) or `in_place` (`Scheduler.pause`). A waiting update runs
    once `abort` has ended what was in flight; paused in place, it could never run: refused."""
    check_fields(msg, frozenset({"op", "rid", "mode"}))
    mode = msg.get("mode", "abort")
    server._publish(server.scheduler.pause(mode))
    if mode == "in_place" and server.scheduler.in_flight():
        fail_pending_update(server, "generation was paused in place before the update could run")
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
