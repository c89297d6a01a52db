"""Plain torch references for the attention kernels: same signatures, one request at a time, fp32 math."""

import math

import torch


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    causal_offset: int,
    window: int | None,
) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D] in fp32: query i (at position
    causal_offset + i) sees the keys at positions up to its own, and with a window W only those
    above its position - W."""
    group = q.shape[1] // k.shape[1]
    q = q.float().transpose(0, 1)  # [Hq, Lq, D]
    k = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, Lk, D]
    v = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    q_pos = causal_offset + torch.arange(q.shape[1], device=q.device)[:, None]
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def extend_attention_ref(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_len_extend: int,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    sliding_window: int | None = None,
) -> None:
    """Request b's new tokens (rows qo_indptr[b]:qo_indptr[b+1]) attend to its whole cached prefix
    (pool slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]) and causally to each other, within
    `sliding_window` when given. max_len_extend is unused."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q_extend.shape[-1])
    for b in range(qo_indptr.numel() - 1):
        qs, qe = qo_indptr[b].item(), qo_indptr[b + 1].item()
        slots = kv_indices[kv_indptr[b].item() : kv_indptr[b + 1].item()].long()
        k = torch.cat([k_buffer[slots], k_extend[qs:qe]])
        v = torch.cat([v_buffer[slots], v_extend[qs:qe]])
        o_extend[qs:qe] = _attend(
            q_extend[qs:qe], k, v, sm_scale, logit_cap, len(slots), sliding_window
        )


def decode_attention_ref(
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
) -> None:
    """Request b's single query attends to its whole context at pool slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    (its last `sliding_window` keys when given).
    num_kv_splits only affects how the kernel parallelizes, not the result."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    for b in range(q.shape[0]):
        slots = kv_indices[kv_indptr[b].item() : kv_indptr[b + 1].item()].long()
        o[b] = _attend(
            q[b : b + 1],
            k_buffer[slots],
            v_buffer[slots],
            sm_scale,
            logit_cap,
            len(slots) - 1,
            sliding_window,
        )[0]
