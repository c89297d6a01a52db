"""LoRA deltas of a batch that mixes adapters (the SGMV/Punica shape), on the CPU in torch.

A batch's rows each belong to one adapter's pool slot, or to the base model (slot -1). The rows
are grouped into segments, one per adapter (stable-sorted by slot, base rows left out), and each
segment multiplies its rows by its adapter's weights alone: `delta = (x @ A) @ B` with `A`
[in, R] and `B` [R, out] the slot's block of one call site's stacked weights (a site fuses
several projections, q/k/v or gate/up: `A` stacks their rank blocks side by side, `B` is block
diagonal, so one pair of matmuls serves them all).

On the CPU each segment is one pair of matmuls over its gathered rows (`grouped`): at a decode
batch of 32 rows over 8 adapters that costs less than multiplying every row by every slot and
masking (measured on one core: 163 against 240 us for a q/k/v site of the default model).
`lora_sgmv.py` is the GPU's Triton kernel over the same segments; `dense_reference` is the
per-row definition the tests hold all of them to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """A batch's rows grouped by adapter: `order` [n] the rows with an adapter, sorted by slot
    (stable: rows ascending within a slot), and per segment its `slots`, `starts` and `ends`
    (offsets into `order`)."""

    order: torch.Tensor
    slots: list[int]
    starts: list[int]
    ends: list[int]

    @classmethod
    def of(cls, row_slots: list[int], device: torch.device | str = "cpu") -> Segments:
        """Group rows whose slots are `row_slots` (one per row, -1 for the base model)."""
        ranked = sorted((s, r) for r, s in enumerate(row_slots) if s >= 0)
        slots, starts, ends = [], [], []
        for i, (slot, _) in enumerate(ranked):
            if not slots or slots[-1] != slot:
                slots.append(slot)
                starts.append(i)
                ends.append(i)
            ends[-1] = i + 1
        return cls(
            torch.tensor([r for _, r in ranked], dtype=torch.long, device=device),
            slots,
            starts,
            ends,
        )


def grouped(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: Segments, per_slot: int
) -> torch.Tensor:
    """[T, out] deltas: per segment, its rows @ its slot's A block @ its slot's B block; `a`
    [in, S * per_slot], `b` [S * per_slot, out]; base rows get zeros."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    if not seg.slots:
        return out
    rows = x.index_select(0, seg.order)
    parts = []
    for slot, start, end in zip(seg.slots, seg.starts, seg.ends):
        block = slice(slot * per_slot, (slot + 1) * per_slot)
        parts.append((rows[start:end] @ a[:, block]) @ b[block])
    return out.index_add_(0, seg.order, torch.cat(parts))


def dense_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: list[int], per_slot: int
) -> torch.Tensor:
    """The definition, row by row: row t's delta is x[t] @ A[slot_t] @ B[slot_t] (0 for -1)."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    for t, slot in enumerate(row_slots):
        if slot >= 0:
            block = slice(slot * per_slot, (slot + 1) * per_slot)
            out[t] = (x[t : t + 1] @ a[:, block]) @ b[block]
    return out
