"""LoRA deltas of a batch that mixes adapters (the SGMV/Punica shape), on the CPU in torch.

A batch's rows each belong to one adapter's pool slot, or to the base model (slot -1). The rows
are grouped into segments, one per adapter (stable-sorted by slot, base rows left out), and each
segment multiplies its rows by its adapter's weights alone: `delta = (x @ A) @ B` with `A`
[in, R] and `B` [R, out] the slot's blocks of one call site's weights, stored slot-major
(`a` [S, in, R], `b` [S, R, out]; a site fuses several projections, q/k/v or gate/up: `A` stacks
their rank blocks side by side, `B` is block diagonal, so one pair of matmuls serves them all).

On the CPU the segments are padded to the longest one and multiplied as two batched matmuls
(`batched`): five torch calls a site whatever the number of adapters, where a loop of a matmul
pair per segment costs its Python and dispatch per adapter (a decode batch of 32 rows over 8
adapters: 4 rows a segment). Padding rows gather row 0, are zeroed, and add their zero delta
back to row 0. `lora_sgmv.py` is the GPU's Triton kernel over the same segments;
`dense_reference` is the per-row definition the tests hold both to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """A batch's rows grouped by adapter: `order` [n] the rows with an adapter, sorted by slot
    (stable: rows ascending within a slot), and per segment its `slots`, `starts` and `ends`
    (offsets into `order`). For the batched CPU path, every segment padded to `longest` rows:
    `gather` [segments * longest] the rows (padding: row 0), `keep` [segments * longest, 1] 1
    for a real row and 0 for padding, and `slot_index` the segments' slots as a tensor."""

    order: torch.Tensor
    slots: list[int]
    starts: list[int]
    ends: list[int]
    longest: int
    gather: torch.Tensor
    keep: torch.Tensor
    slot_index: torch.Tensor

    @classmethod
    def of(cls, row_slots: list[int], device: torch.device | str = "cpu") -> Segments:
        """Group rows whose slots are `row_slots` (one per row, -1 for the base model)."""
        ranked = sorted((s, r) for r, s in enumerate(row_slots) if s >= 0)
        rows = [r for _, r in ranked]
        slots: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for i, (slot, _) in enumerate(ranked):
            if not slots or slots[-1] != slot:
                slots.append(slot)
                starts.append(i)
                ends.append(i)
            ends[-1] = i + 1
        longest = max((e - s for s, e in zip(starts, ends)), default=0)
        gather, keep = [], []
        for s, e in zip(starts, ends):
            pad = longest - (e - s)
            gather += rows[s:e] + [0] * pad
            keep += [1.0] * (e - s) + [0.0] * pad
        return cls(
            torch.tensor(rows, dtype=torch.long, device=device),
            slots,
            starts,
            ends,
            longest,
            torch.tensor(gather, dtype=torch.long, device=device),
            torch.tensor(keep, device=device)[:, None],
            torch.tensor(slots, dtype=torch.long, device=device),
        )


def batched(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: Segments
) -> torch.Tensor:
    """`y` [T, out] plus each row's delta, in place: the padded segments as two batched
    matmuls by their slots' `a` [S, in, R] and `b` [S, R, out] blocks (a view when the
    segments' slots are 0..n-1, else a gathered copy)."""
    n = len(seg.slots)
    if n == 0:
        return y
    if seg.slots != list(range(n)):
        a, b = a.index_select(0, seg.slot_index), b.index_select(0, seg.slot_index)
    rows = x.index_select(0, seg.gather).mul_(seg.keep.to(x.dtype))
    delta = torch.bmm(torch.bmm(rows.view(n, seg.longest, -1), a[:n]), b[:n])
    return y.index_add_(0, seg.gather, delta.view(n * seg.longest, -1))


def dense_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: list[int]
) -> torch.Tensor:
    """The definition, row by row: row t's delta is x[t] @ a[slot_t] @ b[slot_t] (0 for -1)."""
    out = x.new_zeros(x.shape[0], b.shape[2])
    for t, slot in enumerate(row_slots):
        if slot >= 0:
            out[t] = (x[t : t + 1] @ a[slot]) @ b[slot]
    return out
