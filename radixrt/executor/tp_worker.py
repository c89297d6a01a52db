"""Tensor-parallel ranks: the processes rank 0 starts on its node (and `radixrt serve
--node-rank R` on another node), and the commands rank 0 sends them each step.

Rank 0 runs the scheduler, the radix tree and the request->token table; every rank holds a
shard of the model and its own KV pool slice addressed by the same slot indices. Each forward,
rank 0 broadcasts the batch (token ids, positions, output slots, request rows and those rows'
slot lists) as msgpack bytes and one int64 tensor; each logits call, the hidden rows. Idle, it
sends a heartbeat every second. A rank whose rank 0 is gone fails its next receive (or sees its
parent process change) and exits; rank 0 finds a dead rank by a failed send or by its process.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from radixrt.distributed.group import threads_per_rank
from radixrt.executor.forward_batch import ForwardBatch
from radixrt.lifecycle import exit_with_parent

if TYPE_CHECKING:
    from radixrt.config import ExecutorArgs

logger = logging.getLogger(__name__)

FORWARD, LOGITS, HEARTBEAT, SHUTDOWN = "forward", "logits", "heartbeat", "shutdown"
WATCHDOG_PERIOD_S = 1.0
JOIN_TIMEOUT_S = 30


def ranks_per_node(args: ExecutorArgs) -> int:
    if args.tp_size % args.nnodes:
        raise ValueError(f"--tp-size {args.tp_size} does not split over {args.nnodes} nodes")
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
        torch.set_num_threads(threads_per_rank(per_node))
    return LocalRanks(procs), method


def _rank_main(args: ExecutorArgs, rank: int, method: str, parent_pid: int, log_level: int) -> None:
    """A rank process: its shard, then the commands of rank 0 until told to stop."""
    from radixrt.executor.model_runner import ModelRunner  # the runner imports this module

    logging.basicConfig(level=log_level, format=f"[%(asctime)s tp{rank} %(name)s] %(message)s")
    torch.set_num_threads(threads_per_rank(ranks_per_node(args)))
    exit_with_parent(parent_pid)
    try:
        runner = ModelRunner(args, rank, method)
        runner.serve_commands()
        runner.tp.destroy()
    except Exception as e:  # rank 0 gone (a failed receive) or a bug: either way this rank ends
        logger.error("tensor-parallel rank %d stops: %s", rank, e)
        os._exit(1)


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


# ---- the forward command ----------------------------------------------------------------------
def encode_batch(batch: ForwardBatch, req_to_token: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Rank 0: a forward's header and payload: ids, positions, slots, rows, and each row's slot
    list up to its new tokens (the other ranks' request->token tables follow rank 0's)."""
    rows = batch.rows.tolist()
    table = [req_to_token[r, :n].long() for r, n in zip(rows, batch.seq_lens)]
    payload = torch.cat(
        [t.cpu() for t in (batch.input_ids, batch.positions, batch.out_slots, batch.rows, *table)]
    )
    return {
        "op": FORWARD,
        "prefix_lens": batch.prefix_lens,
        "extend_lens": batch.extend_lens,
    }, payload


def decode_batch(
    header: dict, payload: torch.Tensor, req_to_token: torch.Tensor, device: torch.device
) -> ForwardBatch:
    """The other ranks: the batch rank 0 sent, its rows' slot lists written into this rank's
    request->token table."""
    prefix, extend = header["prefix_lens"], header["extend_lens"]
    seq = [p + e for p, e in zip(prefix, extend)]
    t, b = sum(extend), len(prefix)
    ids, positions, slots, rows, table = payload.split([t, t, t, b, sum(seq)])
    for row, part in zip(rows.tolist(), table.split(seq)):
        req_to_token[row, : len(part)] = part.to(device=device, dtype=req_to_token.dtype)
    return ForwardBatch(
        input_ids=ids.to(device),
        positions=positions.to(device),
        out_slots=slots.to(device),
        rows=rows.to(device),
        prefix_lens=list(prefix),
        extend_lens=list(extend),
    )
