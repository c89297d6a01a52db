"""LoRA deltas of a batch that mixes adapters, on the GPU: one Triton launch per call site over
the segments of `kernels/lora.py` (SGMV: segmented gather matrix-vector, Punica's shape).

Each program takes one segment's block of up to BLOCK_M rows (gathered through the segment
order) and one tile of BLOCK_N output columns: it shrinks the rows by its slot's A block
(`[in, R]`, in BLOCK_K steps) into BLOCK_R columns, expands them by the slot's B block, and adds
the result to the rows of `y` in place. Rows are distinct across programs, so the adds never
race. The shrink is recomputed per column tile: R is small beside `in`, and it spares a second
launch. The grid is sized from the segment lengths, which are host data: adapter batches are
not captured in CUDA graphs (docs/architecture.md says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .extend_attention import dot_precision
from .jit import jit
from .lora import Segments

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@jit
def _sgmv_kernel(
    X: tl.tensor,
    A: tl.tensor,
    B: tl.tensor,
    Y: tl.tensor,
    order: tl.tensor,
    seg_starts: tl.tensor,
    seg_ends: tl.tensor,
    seg_slots: tl.tensor,
    K: tl.tensor,
    N: tl.tensor,
    R: tl.tensor,
    stride_x: tl.tensor,
    stride_as: tl.tensor,
    stride_ak: tl.tensor,
    stride_bs: tl.tensor,
    stride_br: tl.tensor,
    stride_y: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    """Y[rows] += (X[rows] @ A[slot]) @ B[slot][:, n-tile] for the rows of segment
    program_id(0)'s row block program_id(1)."""
    seg = tl.program_id(0)
    start = tl.load(seg_starts + seg)
    end = tl.load(seg_ends + seg)
    slot = tl.load(seg_slots + seg)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    offs = first + tl.arange(0, BLOCK_M)
    valid = offs < end
    rows = tl.load(order + offs, mask=valid, other=0)
    rs = tl.arange(0, BLOCK_R)
    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            X + rows[:, None] * stride_x + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        a = tl.load(
            A + slot * stride_as + ks[:, None] * stride_ak + rs[None, :],
            mask=(ks[:, None] < K) & (rs[None, :] < R),
            other=0.0,
        )
        shrunk += tl.dot(x, a, input_precision=DOT_PRECISION)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.load(
        B + slot * stride_bs + rs[:, None] * stride_br + cols[None, :],
        mask=(rs[:, None] < R) & (cols[None, :] < N),
        other=0.0,
    )
    delta = tl.dot(shrunk.to(b.dtype), b, input_precision=DOT_PRECISION)
    out = Y + rows[:, None] * stride_y + cols[None, :]
    keep = valid[:, None] & (cols[None, :] < N)
    y = tl.load(out, mask=keep, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=keep)


def lora_sgmv_fwd(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: Segments
) -> torch.Tensor:
    """`y` [T, out] += each row's delta (`kernels/lora.py`'s `batched`), in place; `a`
    [S, in, R], `b` [S, R, out], rows contiguous. One launch; none for a batch without
    adapters."""
    if not seg.slots:
        return y
    assert x.stride(-1) == 1 and a.stride(-1) == 1 and b.stride(-1) == 1 and y.stride(-1) == 1
    device = x.device
    starts = torch.tensor(seg.starts, dtype=torch.int32, device=device)
    ends = torch.tensor(seg.ends, dtype=torch.int32, device=device)
    slots = torch.tensor(seg.slots, dtype=torch.int32, device=device)
    n, per_slot = b.shape[2], b.shape[1]
    grid = (len(seg.slots), triton.cdiv(seg.longest, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _sgmv_kernel[grid](
        x,
        a,
        b,
        y,
        seg.order.to(device),
        starts,
        ends,
        slots,
        x.shape[1],
        n,
        per_slot,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        BLOCK_R=max(16, triton.next_power_of_2(per_slot)),  # tl.dot's least tile is 16
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return y
