"""All-reduce through shared memory, for CPU ranks on one machine.

gloo's all-reduce costs 0.44 ms for one 576-wide row and 0.83 ms for 32 between two processes
on a 2-core CPU, and a Llama forward needs two per layer. Here each rank copies its part into
its own slot of a shared segment, publishes the call's sequence number in its own cache line,
waits until every rank has published, and sums the slots in rank order, so every rank gets the
same bits. Slots alternate between two sets by the sequence number's parity: a rank can only
reach call s + 2 after every other rank has written call s + 1, which each does only after it
has read call s, so no slot is overwritten while it is read. x86's ordered stores make the
data visible before the flag that announces it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

LINE = 64  # bytes: each rank's flag in a cache line of its own
SLOT_BYTES = 4 << 20  # larger tensors go through gloo
CHECK_EVERY = 1 << 14  # spins between two looks at the clock and the peers


class ShmAllReduce:
    def __init__(self, name: str, rank: int, size: int, create: bool, timeout_s: float):
        total = LINE * size + 2 * size * SLOT_BYTES
        # Attaching registers the name with the resource tracker too; the ranks are rank 0's
        # children and share its tracker, so rank 0's `unlink` settles it for all.
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=total)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.flags = np.ndarray((size, LINE // 8), dtype=np.int64, buffer=self.shm.buf)[:, 0]
        if create:
            self.flags[:] = 0
        data = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=LINE * size)
        self.slots = data.view(2, size, SLOT_BYTES)
        self.seq = 0
        self.peers_alive: Callable[[], None] = lambda: None  # raises when a rank is gone

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same result)."""
        self.seq += 1
        n = x.numel() * x.element_size()
        slots = self.slots[self.seq % 2]
        parts = [slots[r, :n].view(x.dtype).view(x.shape) for r in range(self.size)]
        parts[self.rank].copy_(x)
        self.flags[self.rank] = self.seq
        self._wait()
        acc = parts[0].float() if x.dtype != torch.float32 else x.copy_(parts[0])
        for part in parts[1:]:
            acc.add_(part)
        return x if acc is x else x.copy_(acc)

    def _wait(self) -> None:
        flags, seq = self.flags, self.seq
        spins, deadline = 0, time.monotonic() + self.timeout_s
        while (flags < seq).any():
            spins += 1
            if spins % CHECK_EVERY == 0:
                self.peers_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a tensor-parallel rank did not reach all-reduce {seq}")

    def unlink(self) -> None:
        """Remove the segment's name once every rank has mapped it: nothing is left behind
        however the ranks end."""
        self.shm.unlink()
