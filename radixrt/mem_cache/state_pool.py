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
pool only counts them and copies rows through the model.
"""

from __future__ import annotations

from collections.abc import Callable


class StatePool:
    """`total` slots; `copy(src, dst)` copies slot src's row of every stateful layer to dst."""

    def __init__(self, total: int, copy: Callable[[int, int], None]):
        if total < 1:
            raise ValueError("a recurrent model needs at least one state slot")
        self.total = total
        self.copy = copy
        self._free = list(range(total - 1, -1, -1))  # slot 0 first

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.total and slot not in self._free, "state slot freed twice"
        self._free.append(slot)

    def available(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)
