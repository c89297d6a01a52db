"""A tensor-parallel rank's process group and the collectives the model and the runner use.

Collectives of the forward (the all-reduces after the attention output and the MLP down
projection, the logits gather) run on the compute backend: NCCL on CUDA, gloo on the CPU, where
bf16 and fp16 are reduced in float32 because gloo cannot sum them. CPU ranks on one machine
all-reduce through shared memory (`shm_allreduce`), several times faster than gloo's. Commands from rank 0 (what
the next step computes) travel on a gloo group of their own as msgpack bytes and int64 tensors,
never pickle.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import msgpack
import torch
import torch.distributed as dist

from radixrt.distributed.shm_allreduce import ShmAllReduce

T = TypeVar("T")


def pairwise_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """(p0 + p1) + (p2 + p3) ...: halves summed alone, then added. The deterministic mode sums
    ranks' parts and a linear's input segments this way, so that a sum over the first half of
    a run is one subtree wherever it was computed."""
    if len(parts) == 1:
        return parts[0]
    half = (len(parts) + 1) // 2
    return pairwise_sum(parts[:half]) + pairwise_sum(parts[half:])


# a collective that waits longer than this fails; rank 0 sends a heartbeat every second when idle
COLLECTIVE_TIMEOUT_S = 60


@dataclass
class TPGroup:
    """This process's place among `size` tensor-parallel ranks (`size == 1`: no group at all)."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cpu_group: Any = None  # gloo group for commands (the default group itself on the CPU)
    collective_time: float = 0.0  # seconds this rank spent in collectives and commands
    shm: ShmAllReduce | None = None  # the all-reduce of CPU ranks on one machine
    # --ep-size: each rank holds a share of the experts whole, not a slice of every expert
    expert_parallel: bool = False
    # --enable-deterministic-inference: every all-reduce sums the ranks' parts in one fixed
    # order (pairwise by rank, `fixed_order_sum`) whatever the transport and the tensor's size
    deterministic: bool = False

    def _timed(self, op: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return op()
        finally:
            self.collective_time += time.perf_counter() - start

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and sends every step to the others."""
        return self.rank == 0

    @classmethod
    def init(
        cls, rank: int, size: int, init_method: str, device: torch.device, one_machine: bool
    ) -> TPGroup:
        """Join the group (blocks until all `size` ranks have joined at `init_method`). CPU
        ranks all on one machine all-reduce through shared memory instead of gloo."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        group = cls(rank, size, device, cpu_group)
        if device.type == "cpu" and one_machine:
            if rank == 0:  # create it, then name it to the others
                name = f"radixrt-tp-{uuid.uuid4().hex[:16]}"
                group.shm = ShmAllReduce(name, rank, size, True, COLLECTIVE_TIMEOUT_S)
                group._bytes(name.encode())
            else:
                name = group._bytes(None).decode()
                group.shm = ShmAllReduce(name, rank, size, False, COLLECTIVE_TIMEOUT_S)
            dist.barrier(group=cpu_group)
            if rank == 0:
                group.shm.unlink()
        return group

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # ---- the forward's collectives ---------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size == 1:
            return x
        if self.deterministic and self.size > 2:
            return self._timed(lambda: self._fixed_order_all_reduce(x))
        # two ranks: every path below adds rank 0's part and rank 1's, the same bits either way
        shm = self.shm
        if shm is not None and shm.fits(x):
            return self._timed(lambda: shm(x))
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            self._timed(lambda: dist.all_reduce(wide))
            return x.copy_(wide)
        self._timed(lambda: dist.all_reduce(x))
        return x

    def _fixed_order_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`all_reduce` in the pairwise rank order of `pairwise_sum`, in float32: gloo's and
        NCCL's rings sum an element in an order that depends on which chunk of the tensor it
        falls in, so on the tensor's size (the batch)."""
        wide = x.float().contiguous()
        parts = [torch.empty_like(wide) for _ in range(self.size)]
        dist.all_gather(parts, wide)
        return x.copy_(pairwise_sum(parts))

    def gather_last_dim(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank r's `x` [rows, widths[r]] side by side on rank 0 (None on the others)."""
        if self.size == 1:
            return x
        pad = max(widths) - x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()
        parts = [torch.empty_like(padded) for _ in widths] if self.is_driver else None
        self._timed(lambda: dist.gather(padded, parts, dst=0))
        if parts is None:
            return None
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (same shape and dtype everywhere), in place."""
        self._timed(lambda: dist.broadcast(x, 0))
        return x

    def agree(self, value: int) -> int:
        """Rank 0's `value` on every rank (a size all ranks must share, such as the pool's)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(box, 0, group=self.cpu_group)
        return int(box)

    def barrier(self) -> None:
        """Return once every rank has called it: rank 0 waits for the others to finish a
        command (a weight update, whose files the caller removes after)."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    # ---- commands from rank 0 --------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        """Rank 0: a command as msgpack bytes, then an optional int64 CPU payload."""
        data = msgpack.packb({**header, "payload": 0 if payload is None else len(payload)})
        self._timed(lambda: self._bytes(data))
        if payload is not None:
            payload = payload.to(torch.int64).contiguous()
            self._timed(lambda: dist.broadcast(payload, 0, group=self.cpu_group))

    def recv(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The other ranks: the next command from rank 0 and its payload."""
        header = msgpack.unpackb(self._bytes(None))
        payload = None
        if header["payload"]:
            payload = torch.empty(header["payload"], dtype=torch.int64)
            dist.broadcast(payload, 0, group=self.cpu_group)
        return header, payload

    def _bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.cpu_group)
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.cpu_group)
        return buf.numpy().tobytes()
