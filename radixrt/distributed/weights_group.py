"""A process group with a trainer, for `init_weights_update_group` and
`update_weights_from_distributed` (SGLang's names; docs/rl.md): the trainer is rank 0 and
broadcasts named tensors, the runtime joins at `rank_offset` and receives them.

The group is its own (a `TCPStore` at the trainer's address and a gloo group over it), apart
from the tensor-parallel group and from torch's default one, so a runtime may join several
trainers' groups by name. Tensors travel as broadcasts of their raw values: nothing is pickled.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

JOIN_TIMEOUT_S = 300.0  # the trainer joins within this (the runtime's loop waits meanwhile)


class WeightsGroup:
    """This runtime's membership of one trainer's group."""

    def __init__(self, address: str, port: int, rank: int, world_size: int):
        """Join (blocks until every member has, at most JOIN_TIMEOUT_S: then RuntimeError)."""
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        self.store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.rank, self.world_size = rank, world_size

    def receive(self, tensors: list[torch.Tensor]) -> None:
        """Fill `tensors`, in order, each from a broadcast of the trainer (rank 0)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            self.group.broadcast([tensor], options).wait()
