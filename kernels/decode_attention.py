"""Decode attention: one query token per request over its context in the paged KV pool
(split-KV): the whole context, or with a sliding window W only its last W keys, which the splits
divide among them."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .extend_attention import (
    _attend_block,
    _check_last_dim_contiguous,
    _load_rows,
    check_kv_rows,
    dot_precision,
)
from .jit import jit


@jit
def _span(
    kv_indptr: tl.tensor, b: tl.tensor, WINDOW: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Request b's context: where its slots start in kv_indices, how many, and the first one
    its query sees (the last WINDOW of them when WINDOW > 0)."""
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    first = 0
    if WINDOW > 0:
        first = tl.maximum(kv_len - WINDOW, 0)
    return kv_start, kv_len, first


@jit
def _decode_split_kernel(
    Q: tl.tensor,
    K_buf: tl.tensor,
    V_buf: tl.tensor,
    Mid_O: tl.tensor,
    Mid_LSE: tl.tensor,
    kv_indptr: tl.tensor,
    kv_indices: tl.tensor,
    sm_scale: tl.tensor,
    stride_qb: tl.tensor,
    stride_qh: tl.tensor,
    stride_kbs: tl.tensor,
    stride_kbh: tl.tensor,
    stride_vbs: tl.tensor,
    stride_vbh: tl.tensor,
    stride_mob: tl.tensor,
    stride_moh: tl.tensor,
    stride_mos: tl.tensor,
    stride_mlb: tl.tensor,
    stride_mlh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr,
) -> None:
    """Stage 1: one program per (request, kv head, split) serves all query heads of that kv head,
    so each K/V block is read once per group. Writes the split's normalized output and its log2-sum-exp."""
    b = tl.program_id(0)
    kv_start, kv_len, first = _span(kv_indptr, b, WINDOW)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    split_len = tl.cdiv(kv_len - first, tl.num_programs(2))
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    if lo >= hi:  # context shorter than the number of splits; stage 2 skips this split too
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM

    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < hi
        slots = tl.load(kv_indices + kv_start + cols, mask=mask_n, other=0).to(tl.int64)
        k = _load_rows(
            K_buf,
            slots,
            kvh,
            stride_kbs,
            stride_kbh,
            offs_d,
            mask_n,
            mask_d,
            q.dtype,
            HEAD_DIM,
            KV_KIND,
        )
        v = _load_rows(
            V_buf,
            slots,
            kvh,
            stride_vbs,
            stride_vbh,
            offs_d,
            mask_n,
            mask_d,
            q.dtype,
            HEAD_DIM,
            KV_KIND,
        )
        m_i, l_i, acc = _attend_block(
            q, k, v, mask_n[None, :], m_i, l_i, acc, sm_scale, LOGIT_CAP, DOT_PRECISION
        )

    tl.store(
        Mid_O + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
        acc / l_i[:, None],
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(Mid_LSE + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_h)


@jit
def _decode_merge_kernel(
    Mid_O: tl.tensor,
    Mid_LSE: tl.tensor,
    O: tl.tensor,
    kv_indptr: tl.tensor,
    num_splits: tl.tensor,
    stride_mob: tl.tensor,
    stride_moh: tl.tensor,
    stride_mos: tl.tensor,
    stride_mlb: tl.tensor,
    stride_mlh: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WINDOW: tl.constexpr,
) -> None:
    """Stage 2: one program per (request, query head) combines the non-empty splits by their log-sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)

    _, kv_len, first = _span(kv_indptr, b, WINDOW)
    split_len = tl.cdiv(kv_len - first, num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = (offs_s < num_splits) & (offs_s * split_len < kv_len - first)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        Mid_LSE + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf")
    )
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        Mid_O + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


def _launch_config(block_d: int) -> dict[str, int]:
    # Untuned starting point; `radixrt bench --workload gpu-check` (radixrt/bench/gpu_check.py)
    # sweeps alternatives by patching this function.
    return dict(BLOCK_N=64 if block_d <= 128 else 32, num_warps=4, num_stages=2)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: int = 8,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    sliding_window: int | None = None,
    kv_kind: int | None = None,
) -> None:
    """Attention for one new token per request, written into o [B, Hq, D].

    q [B, Hq, D]; request b's context (its current token included) is at slots
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] of k_buffer/v_buffer [slots, Hkv, D]; it must be non-empty.
    With `sliding_window` W the query sees only the context's last W keys (the context is still
    given whole, so one layout serves every layer; the keys before the window are not read).
    With `kv_kind` (`KVFormat.kernel_kind`) the buffers hold quantized rows `[slots, Hkv, D + 4]`
    (codes, then a float32 scale), dequantized as read.
    """
    _check_last_dim_contiguous(q, k_buffer, v_buffer, o)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0 and head_dim <= 256 and num_kv_splits >= 1
    kind = check_kv_rows(k_buffer, head_dim, kv_kind)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if batch == 0:
        return

    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    mid_o = torch.empty(
        batch, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty(batch, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)

    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        mid_o,
        mid_lse,
        kv_indptr,
        kv_indices,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs at least 16 rows
        LOGIT_CAP=logit_cap,
        WINDOW=sliding_window or 0,
        DOT_PRECISION=dot_precision(q.dtype),
        KV_KIND=kind,
        **_launch_config(block_d),
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        o,
        kv_indptr,
        num_kv_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        WINDOW=sliding_window or 0,
        num_warps=4,
    )
