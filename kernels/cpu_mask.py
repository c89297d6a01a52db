"""Constraint masks applied to float32 logits on the CPU in one C pass.

The torch path (`radixrt.structured.bitmask`) expands every bit of the batch's int32 bitmask into
a word-sized temporary, compares it and fills: at batch 64 over a 49k vocabulary that is about
12 MB of temporaries and a dozen ms a decode step, most of the cost of constrained decoding. Here
each 32-bit word is read once: all ones (everything allowed) is skipped, all zeros (the common
case: a constraint allows few tokens) writes 32 -infs, and a mixed word is walked bit by bit.
Built on first use (`native`); where it cannot be built, callers keep the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

SOURCE = native.CSRC / "cpu_mask.c"
P, I = native.POINTER, native.INT64
SIGNATURES = (("apply_bitmask", (P, P, P) + (I,) * 4),)


def _library() -> ctypes.CDLL | None:
    return native.load("cpu_mask", SOURCE, SIGNATURES)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> bool:
    """In place, as `radixrt.structured.bitmask.apply_bitmask` (bitmask rows line up with logits
    rows; only `rows`, or all); False, untouched, where this kernel does not apply: logits not
    float32 rows on the CPU with unit column stride, a bitmask not contiguous int32, or no
    library."""
    if (
        logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bitmask.dtype != torch.int32
        or not bitmask.is_contiguous()
        or bitmask.shape[0] < logits.shape[0]
        or _library() is None
    ):
        return False
    assert rows is None or all(0 <= r < logits.shape[0] for r in rows)
    index = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    count = logits.shape[0] if index is None else len(index)
    native.built(_library()).apply_bitmask(
        logits.data_ptr(),
        bitmask.data_ptr(),
        None if index is None else index.data_ptr(),
        count,
        logits.shape[1],
        logits.stride(0),
        bitmask.shape[1],
    )
    return True
