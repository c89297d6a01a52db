"""Tensor-parallel ranks: the processes rank 0 starts on its node (and `radixrt serve
--node-rank R` on another node), the loop each of them runs, and `TPDriver`, rank 0's side.

Rank 0 runs the scheduler, the radix tree and the request->token table; every rank holds a
shard of the model and its own KV pool slice addressed by the same slot indices. Each forward,
rank 0 broadcasts the batch (`radixrt.distributed.commands`: token ids, positions, output
slots, request rows and those rows' slot lists) as msgpack bytes and one int64 tensor; each
logits call, the hidden rows. Idle, it sends a heartbeat every second. A rank whose rank 0 is
gone fails its next receive (or sees its parent process change) and exits; rank 0 finds a dead
rank by a failed send or by its process.

Imports run one way: this module uses `model_runner`, which knows nothing of ranks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from radixrt.config import physical_cores
from radixrt.distributed.commands import (
    FORWARD,
    HEARTBEAT,
    LOAD_LORA,
    LOGITS,
    RELEASE_KV,
    RESUME_KV,
    SHUTDOWN,
    UNLOAD_LORA,
    UPDATE_WEIGHTS,
    decode_forward,
    encode_forward,
    logits_header,
)
from radixrt.distributed.group import TPGroup
from radixrt.distributed.weights_group import WeightsGroup
from radixrt.executor.lora_manager import AdapterInfo, LoraManager
from radixrt.executor.model_loader import resolve_model_path
from radixrt.executor.model_runner import ModelRunner, resolve_device
from radixrt.executor.weight_update import TensorSpec
from radixrt.forward_batch import ForwardBatch
from radixrt.lifecycle import exit_with_parent
from radixrt.models.lora import AdapterError

if TYPE_CHECKING:
    from radixrt.config import ExecutorArgs

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 1.0
JOIN_TIMEOUT_S = 30


def threads_per_rank(local_ranks: int, cpu_threads: int = 0) -> int:
    """CPU threads each of this machine's ranks takes: its share of `--cpu-threads`, else of
    the OMP_NUM_THREADS this process was given (as a data-parallel worker is), else of the
    physical cores."""
    total = cpu_threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or physical_cores()
    return max(1, total // local_ranks)


def ranks_per_node(args: ExecutorArgs) -> int:
    """`tp_size` splits evenly over `nnodes` (`ParallelSettings` checks it)."""
    return args.tp_size // args.nnodes


def local_rank(args: ExecutorArgs, rank: int) -> int:
    """A rank's index on its own node (its GPU on CUDA)."""
    return rank % ranks_per_node(args)


def _init_method(args: ExecutorArgs) -> str:
    """Where the ranks meet: `--dist-init-addr`, or a free loopback port on one node."""
    if args.dist_init_addr:
        return f"tcp://{args.dist_init_addr}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class LocalRanks:
    """This node's rank processes other than the caller."""

    def __init__(self, procs: dict[int, Any]):
        self.procs = procs  # rank -> process

    def check_alive(self) -> None:
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {proc.exitcode})")

    def join(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs.values():
            proc.join(max(deadline - time.monotonic(), 0.1))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()


def start_local_ranks(args: ExecutorArgs) -> tuple[LocalRanks, str]:
    """Start this node's ranks (rank 0 excepted: that is the caller on node 0); returns them
    and where the group meets."""
    method = _init_method(args)
    per_node = ranks_per_node(args)
    first = args.node_rank * per_node
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in range(first, first + per_node):
        if rank == 0:
            continue
        proc = ctx.Process(
            target=_rank_main,
            args=(args, rank, method, os.getpid(), logging.getLogger().level),
            name=f"radixrt-tp{rank}",
            daemon=True,
        )
        proc.start()
        procs[rank] = proc
    if args.node_rank == 0:
        torch.set_num_threads(threads_per_rank(per_node, args.cpu_threads))
    return LocalRanks(procs), method


def _join_group(args: ExecutorArgs, rank: int, init_method: str) -> TPGroup:
    """This rank's place in the group, on its own device (blocks until every rank has joined)."""
    device = resolve_device(args.device, local_rank(args, rank))
    group = TPGroup.init(rank, args.tp_size, init_method, device, args.nnodes == 1)
    group.expert_parallel = args.ep_size > 1
    group.deterministic = args.enable_deterministic_inference
    return group


def _rank_main(args: ExecutorArgs, rank: int, method: str, parent_pid: int, log_level: int) -> None:
    """A rank process: its shard, then the commands of rank 0 until told to stop."""
    logging.basicConfig(level=log_level, format=f"[%(asctime)s tp{rank} %(name)s] %(message)s")
    torch.set_num_threads(threads_per_rank(ranks_per_node(args), args.cpu_threads))
    exit_with_parent(parent_pid)
    try:
        tp = _join_group(args, rank, method)
        serve_commands(ModelRunner(args, tp))
        tp.destroy()
    except Exception as e:  # rank 0 gone (a failed receive) or a bug: either way this rank ends
        logger.error("tensor-parallel rank %d stops: %s", rank, e)
        os._exit(1)


def serve_commands(runner: ModelRunner) -> None:
    """Ranks other than 0: run what rank 0 sends, in its order, until it says to stop."""
    tp, req_to_token = runner.tp, runner.req_to_token_pool.req_to_token
    while True:
        header, payload = tp.recv()
        op = header["op"]
        if op == FORWARD:
            assert payload is not None  # a step's ids, positions and slots
            runner.forward(decode_forward(header, payload, req_to_token))
        elif op == LOGITS:
            hidden = torch.empty(
                (header["rows"], runner.config.hidden_size),
                dtype=runner.dtype,
                device=runner.device,
            )
            runner.logits(tp.broadcast(hidden))
        elif op == LOAD_LORA:
            assert runner.lora is not None  # rank 0 sends one only after its own pool (`_lora`)
            runner.lora.load(header["name"], header["path"])
        elif op == UNLOAD_LORA:
            assert runner.lora is not None
            runner.lora.unload(header["name"])
        elif op == UPDATE_WEIGHTS:
            runner.update_weights(Path(header["path"]), header["checkpoint"])
            tp.barrier()
        elif op == RELEASE_KV:
            runner.release_kv()
        elif op == RESUME_KV:
            runner.resume_kv()
        elif op == SHUTDOWN:
            return


def run_node(args: ExecutorArgs) -> int:
    """`radixrt serve --node-rank R` (R > 0): host this node's ranks until they end; returns an
    exit code. Stopping this process (SIGTERM, Ctrl-C) stops them."""
    ranks, _ = start_local_ranks(args)
    try:
        while all(p.is_alive() for p in ranks.procs.values()):
            time.sleep(WATCHDOG_PERIOD_S)
    finally:
        ranks.join()
    return max((p.exitcode or 0) for p in ranks.procs.values())


class TPDriver:
    """Rank 0's runner: each forward and logits call is first sent to the group's other ranks
    (which run `serve_commands`), then run here. With `tp_size` 1 there is no one to tell, and
    it only delegates. `runner` is the model, its pools and its tokenizer."""

    def __init__(self, runner: ModelRunner, ranks: LocalRanks | None = None):
        self.runner = runner
        self.tp = runner.tp
        self.ranks = ranks  # the other ranks on this node, watched for a death
        self.weights_groups: dict[str, WeightsGroup] = {}  # trainers' groups, by name

    @classmethod
    def start(cls, args: ExecutorArgs) -> TPDriver:
        """Rank 0 with its group: this node's other ranks started, the group joined, the
        model loaded (`tp_size` 1: just the model)."""
        if args.tp_size == 1:
            torch.set_num_threads(threads_per_rank(1, args.cpu_threads))
            return cls(ModelRunner(args))
        resolve_model_path(args.model)  # a GGUF is converted once, here, not by every rank
        ranks, method = start_local_ranks(args)
        tp = _join_group(args, 0, method)
        if tp.shm is not None:
            tp.shm.peers_alive = ranks.check_alive  # a dead rank is not waited for
        return cls(ModelRunner(args, tp), ranks)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """`ModelRunner.forward` on every rank; rank 0's hidden states."""
        if self.tp.size > 1:
            self.tp.send(*encode_forward(batch, self.runner.req_to_token_pool.req_to_token))
        return self.runner.forward(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`ModelRunner.logits` on every rank, over rank 0's `hidden`; the whole vocabulary's."""
        if self.tp.size > 1:
            self.tp.send(logits_header(len(hidden)))
            self.tp.broadcast(hidden.contiguous())
        logits = self.runner.logits(hidden)
        assert logits is not None  # rank 0 gathers
        return logits

    def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Load an adapter on rank 0 (AdapterError when it cannot be served), then on the
        other ranks, each reading its own slices."""
        info = self._lora().load(name, path)
        if self.tp.size > 1:
            self.tp.send({"op": LOAD_LORA, "name": name, "path": path})
        return info

    def unload_lora(self, name: str) -> None:
        self._lora().unload(name)
        if self.tp.size > 1:
            self.tp.send({"op": UNLOAD_LORA, "name": name})

    def update_weights(self, folder: Path, checkpoint: bool) -> None:
        """`ModelRunner.update_weights` on rank 0 (a ValueError names what it refuses, and no
        rank's weights change), then on the other ranks, each loading its own shard of the
        same files as at start (they must see `folder` too: one node, or a shared path);
        returns once every rank has (the caller may then remove the files)."""
        self.runner.update_weights(folder, checkpoint)
        if self.tp.size > 1:
            self.tp.send({"op": UPDATE_WEIGHTS, "path": str(folder), "checkpoint": checkpoint})
            self.tp.barrier()

    def check_weights_group(self, name: str) -> None:
        """ValueError when this runtime cannot join a group named `name`: under tensor
        parallelism (each rank would have to join) or when it is in one of that name."""
        if self.tp.size > 1:
            raise ValueError("weights from a trainer's group need --tp-size 1")
        if name in self.weights_groups:
            raise ValueError(f"this runtime is in a group named {name!r} already")

    @staticmethod
    def join_weights_group(
        address: str, port: int, rank: int, world_size: int, timeout: float
    ) -> WeightsGroup:
        """Join a trainer's group as `rank` (`WeightsGroup`: blocks until every member has);
        any thread may call it, since it touches nothing of this driver's."""
        return WeightsGroup(address, port, rank, world_size, timeout)

    def add_weights_group(self, name: str, group: WeightsGroup) -> None:
        """Keep a joined group under `name` (checked again: another may have joined since)."""
        self.check_weights_group(name)
        self.weights_groups[name] = group

    def leave_weights_group(self, name: str) -> None:
        if self.weights_groups.pop(name, None) is None:
            raise ValueError(f"this runtime is in no group named {name!r}")

    def weights_receiver(
        self, name: str, specs: list[TensorSpec]
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """What receives the tensors the trainer broadcasts over group `name` (by name), to
        run on any thread: it holds the group itself, so a later leave does not pull it away.
        ValueError, now, for a group this runtime is not in."""
        group = self.weights_groups.get(name)
        if group is None:
            raise ValueError(f"this runtime is in no group named {name!r}")

        def receive() -> dict[str, torch.Tensor]:
            tensors = {spec.name: spec.empty() for spec in specs}
            group.receive(list(tensors.values()))
            return tensors

        return receive

    def release_kv(self) -> None:
        """Free the KV pool's memory on every rank."""
        self.runner.release_kv()
        if self.tp.size > 1:
            self.tp.send({"op": RELEASE_KV})

    def resume_kv(self) -> None:
        self.runner.resume_kv()
        if self.tp.size > 1:
            self.tp.send({"op": RESUME_KV})

    def _lora(self) -> LoraManager:
        if self.runner.lora is None:
            raise AdapterError(
                "this server serves no adapters: start it with --enable-lora or --lora-paths"
            )
        return self.runner.lora

    def heartbeat(self) -> None:
        """While idle: show the other ranks rank 0 is alive, and find out whether they are
        (a dead rank fails the broadcast, or its process is seen gone)."""
        if self.tp.size > 1:
            if self.ranks is not None:
                self.ranks.check_alive()
            self.tp.send({"op": HEARTBEAT})

    def close(self) -> None:
        """Stop this group's other ranks (they exit) and leave the group."""
        if self.tp.size > 1:
            try:
                self.tp.send({"op": SHUTDOWN})
            except RuntimeError:  # a rank is already gone: the rest notice on their own
                pass
            if self.ranks is not None:
                self.ranks.join()
            self.tp.destroy()
