"""A process group with a trainer, for `init_weights_update_group` and
`update_weights_from_distributed` (SGLang's names; docs/rl.md): the trainer is rank 0 and
broadcasts named tensors, the runtime joins at `rank_offset` and receives them.

The group is its own (a `TCPStore` at the trainer's address and a gloo group over it), apart
from the tensor-parallel group and from torch's default one, so a runtime may join several
trainers' groups by name. Tensors travel as broadcasts of their raw values: nothing is pickled.

Joining and receiving block, so the runtime runs both on a thread beside its serving loop
(server/rollout.py), which answers at its own deadline even where torch does not: a TCPStore
client whose peer accepts the connection and never speaks waits past any timeout given to it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class WeightsGroup:
    """This runtime's membership of one trainer's group."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout: float):
        """Join: blocks until every member has, at most `timeout` seconds for each of torch's
        waits. TimeoutError when the store or a member does not answer in time,
        ConnectionError when the address cannot be reached (each names the address)."""
        wait = datetime.timedelta(seconds=timeout)
        try:
            # torch.distributed re-exports TCPStore without `as`, so its stubs do not export it
            self.store = dist.TCPStore(  # type: ignore[attr-defined]
                address, port, world_size, is_master=False, timeout=wait
            )
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, wait)
        except dist.DistNetworkError as e:
            raise ConnectionError(f"the trainer's group at {address}:{port}: {e}") from None
        except dist.DistError as e:
            raise TimeoutError(f"the trainer's group at {address}:{port}: {e}") from None
        self.rank, self.world_size = rank, world_size

    def receive(self, tensors: list[torch.Tensor]) -> None:
        """Fill `tensors`, in order, each from a broadcast of the trainer (rank 0); each waits
        at most the group's timeout (then torch's error)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            # torch's stubs give a Backend no collectives; the pybind class has them
            self.group.broadcast([tensor], options).wait()  # type: ignore[attr-defined]
