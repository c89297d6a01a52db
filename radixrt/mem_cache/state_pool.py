"""Slots of per-request recurrent state, beside the paged KV pool (`--max-mamba-cache-size`).

A model whose layers carry a state besides their KV (a convolution's last inputs, a linear
attention's or a state-space layer's recurrence) holds one buffer per such layer with a row per
slot (`CausalLM.allocate_states`). A slot is, at any time, exactly one of:

| owner                      | what the slot holds                                  |
|----------------------------|------------------------------------------------------|
| the free list              | nothing                                              |
| one running request        | its state after its computed tokens (`kv_len`)       |
| one radix-tree node        | a snapshot: the state after the node's last token    |

A request that matches a prefix ending at a node with a snapshot starts from a copy of it (the
node keeps its own); one that ends gives its slot to the node ending where its state is, or
back to the free list. The manager of both (`slot_manager.KVSlotManager`) moves the slots; this
pool only counts them and moves rows: between slots (`copy`), and out to and in from the disk
tier (`save`, `load`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StatePool:
    """`total` slots over the model's state `buffers` (`CausalLM.allocate_states`: each
    [total, ...]; slot s is row s of every one)."""

    def __init__(self, total: int, buffers: Sequence[torch.Tensor]):
        if total < 1:
            raise ValueError("a recurrent model needs at least one state slot")
        assert all(len(b) == total for b in buffers), "a row of every buffer per slot"
        self.total = total
        self.buffers = list(buffers)
        self.nbytes = sum(b.nbytes for b in self.buffers)
        self._free = list(range(total - 1, -1, -1))  # slot 0 first

    def copy(self, src: int, dst: int) -> None:
        """Slot src's state into slot dst (a snapshot taken, or resumed from)."""
        for b in self.buffers:
            b[dst] = b[src]

    def save(self, slot: int) -> list[torch.Tensor]:
        """A copy of the slot's state on the CPU, one tensor per buffer (for the disk tier)."""
        return [b[slot].to("cpu", copy=True) for b in self.buffers]

    def load(self, slot: int, state: Sequence[torch.Tensor]) -> None:
        """Write `state` (as `save` returns it, of `layout`'s shapes) into the slot."""
        for b, t in zip(self.buffers, state, strict=True):
            b[slot] = t

    @property
    def layout(self) -> list[tuple[torch.Size, torch.dtype]]:
        """One slot's tensors' shapes and dtypes: what a stored state must have."""
        return [(b.shape[1:], b.dtype) for b in self.buffers]

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.total and slot not in self._free, "state slot freed twice"
        self._free.append(slot)

    def available(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)
