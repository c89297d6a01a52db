"""Prefill ("extend") attention: new tokens attend to their cached prefix in the paged KV pool
and causally to each other; with a sliding window W, a query at position p only to the keys at
positions above p - W, and the loops start at the first key a query tile sees.

Both kernels read a float pool or a quantized one (`--kv-cache-dtype`, `KV_KIND`): the pool's
own rows, one-byte codes then a float32 scale per (token, KV head) (radixrt/mem_cache/
kv_quant.py), dequantized as a tile is loaded (`_load_rows`). That row format, rather than a
static scale per head, is kept on the GPU because the host and disk tiers and swap already
move it as bytes, it needs no calibration pass, and a scale per row bounds each row's error by
its own largest value; its cost is 4 bytes a row (6% at head size 64, 3% at 128), one scalar
load per key, and rows only 4-byte aligned (D + 4 bytes): compiled for sm_90, the decode
kernel copies a tile's codes 4 bytes a `cp.async` where bf16 rows go 16 at a time. Should
`radixrt bench --workload gpu-check --gpu-sections check_kv_quant` find decode slower than
bf16 KV for it, rows padded to 16 bytes or the scales in an array of their own are the ways
out.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .jit import jit


@jit
def _scores(qk: tl.tensor, sm_scale: tl.tensor, LOGIT_CAP: tl.constexpr) -> tl.tensor:
    """Raw q.k products -> softmax logits in log2 units (so the kernels can use exp2)."""
    qk = qk * sm_scale
    if LOGIT_CAP > 0:
        # cap * tanh(x / cap), with tanh(y) = 2 * sigmoid(2y) - 1
        qk = LOGIT_CAP * (2.0 * tl.sigmoid(qk * (2.0 / LOGIT_CAP)) - 1.0)
    return qk * 1.4426950408889634


@jit
def _attend_block(
    q: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    visible: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    sm_scale: tl.tensor,
    LOGIT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold one key/value block into an online softmax: the running max m_i (log2 units), the
    running sum l_i and the unnormalised output acc; `visible` masks the keys a query may see.
    A row that has seen no key yet (its window starts past this block) stays at -inf and 0."""
    qk = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), sm_scale, LOGIT_CAP)
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) would be NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@jit
def _codes_to_float(x: tl.tensor, KV_KIND: tl.constexpr) -> tl.tensor:
    """One-byte codes, loaded as int8 -> their float32 values: int8 (KV_KIND 0) as is; an FP8
    code (1 E4M3, 2 E5M2) through the half-precision float with its sign, exponent and mantissa
    bits (E5M2 is a half's top byte; E4M3's exponent bias is 7 to a half's 15: times 2^8). Exact
    for every finite code, and integer ops and a bitcast only, so every GPU Triton runs on (FP8
    conversions need sm_89) and the interpreter decode alike."""
    if KV_KIND == 0:
        y = x.to(tl.float32)
    elif KV_KIND == 1:
        u = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        half = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
        y = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        u = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        y = (u << 8).to(tl.float16, bitcast=True).to(tl.float32)
    return y


@jit
def _load_rows(
    buf: tl.tensor,
    slots: tl.tensor,
    kvh: tl.tensor,
    stride_s: tl.tensor,
    stride_h: tl.tensor,
    offs_d: tl.tensor,
    mask_n: tl.tensor,
    mask_d: tl.tensor,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_KIND: tl.constexpr,
) -> tl.tensor:
    """KV head `kvh`'s rows at pool `slots` [BLOCK_N] -> a tile [BLOCK_N, BLOCK_D] in `dtype`
    (the query's), 0 where masked. KV_KIND -1: a float pool, loaded as is; else
    (`KVFormat.kernel_kind`) codes times the float32 scale stored after them, at byte HEAD_DIM
    of the row (the wrappers check it is 4-aligned)."""
    offset = slots * stride_s + kvh * stride_h
    if KV_KIND >= 0:  # rows of D + 4 bytes, D % 4 == 0: tell the compiler, so codes load by word
        offset = tl.multiple_of(offset, 4)
    rows = buf + offset
    x = tl.load(rows[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0)
    if KV_KIND >= 0:
        scale = tl.load((rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=mask_n, other=0)
        x = _codes_to_float(x, KV_KIND) * scale[:, None]
    return x.to(dtype)


@jit
def _extend_kernel(
    Q: tl.tensor,
    K_ext: tl.tensor,
    V_ext: tl.tensor,
    O: tl.tensor,
    K_buf: tl.tensor,
    V_buf: tl.tensor,
    qo_indptr: tl.tensor,
    kv_indptr: tl.tensor,
    kv_indices: tl.tensor,
    sm_scale: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_kbs: tl.tensor,
    stride_kbh: tl.tensor,
    stride_vbs: tl.tensor,
    stride_vbh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    h = tl.program_id(1)
    start_m = tl.program_id(2) * BLOCK_M
    kvh = h // GROUP

    q_start = tl.load(qo_indptr + b)
    extend_len = tl.load(qo_indptr + b + 1) - q_start
    if start_m >= extend_len:
        return
    kv_start = tl.load(kv_indptr + b)
    prefix_len = tl.load(kv_indptr + b + 1) - kv_start

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM

    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Stage 1: the cached prefix, gathered slot by slot through kv_indices; no causal mask needed.
    # Query m (position prefix_len + m) sees prefix key n while prefix_len + m - n < WINDOW.
    prefix_lo = 0
    if WINDOW > 0:
        prefix_lo = tl.maximum(prefix_len + start_m - WINDOW + 1, 0)
    for start_n in range(prefix_lo, prefix_len, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < prefix_len
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
        visible = mask_n[None, :]
        if WINDOW > 0:
            visible = visible & (prefix_len + offs_m[:, None] - cols[None, :] < WINDOW)
        m_i, l_i, acc = _attend_block(
            q, k, v, visible, m_i, l_i, acc, sm_scale, LOGIT_CAP, DOT_PRECISION
        )

    # Stage 2: the new tokens themselves, causal; only blocks up to this query block's end are visible.
    end_n = tl.minimum(start_m + BLOCK_M, extend_len)
    new_lo = 0
    if WINDOW > 0:
        new_lo = tl.maximum(start_m - WINDOW + 1, 0)
    for start_n in range(new_lo, end_n, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < extend_len
        mask_nd = mask_n[:, None] & mask_d[None, :]
        kv_rows = (q_start + cols).to(tl.int64)
        k = tl.load(
            K_ext + kv_rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=mask_nd,
            other=0.0,
        )
        v = tl.load(
            V_ext + kv_rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=mask_nd,
            other=0.0,
        )
        # Every row sees at least itself in this loop, so its sum ends positive.
        visible = mask_n[None, :] & (offs_m[:, None] >= cols[None, :])
        if WINDOW > 0:
            visible = visible & (offs_m[:, None] - cols[None, :] < WINDOW)
        m_i, l_i, acc = _attend_block(
            q, k, v, visible, m_i, l_i, acc, sm_scale, LOGIT_CAP, DOT_PRECISION
        )

    out = acc / l_i[:, None]
    tl.store(
        O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "attention kernels need a contiguous head dim"


def check_kv_rows(k_buffer: torch.Tensor, head_dim: int, kv_kind: int | None) -> int:
    """The kernels' KV_KIND for a pool of `k_buffer`'s rows read as `kv_kind` (None: float rows
    `[slots, Hkv, head_dim]`; else `KVFormat.kernel_kind`: int8 rows `[slots, Hkv, head_dim + 4]`,
    codes then scale, with head_dim a multiple of 4 so each scale's float32 load is aligned)."""
    if kv_kind is None:
        assert k_buffer.shape[-1] == head_dim, "float KV rows are head_dim wide"
        return -1
    assert kv_kind in (0, 1, 2), f"unknown KV kind {kv_kind}"
    assert k_buffer.dtype == torch.int8 and k_buffer.shape[-1] == head_dim + 4, (
        "quantized KV rows are int8 [head_dim codes + a float32 scale]"
    )
    assert head_dim % 4 == 0, "a quantized row's scale is read as an aligned float32"
    return kv_kind


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently get tf32 tensor-core dots on GPU; keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_config(block_d: int) -> dict[str, int]:
    # Untuned starting point; `radixrt bench --workload gpu-check` (radixrt/bench/gpu_check.py)
    # sweeps alternatives by patching this function.
    if block_d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4 if block_d <= 64 else 8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def extend_attention_fwd(
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
    kv_kind: int | None = None,
) -> None:
    """Attention for the new tokens of a batch of requests, written into o_extend.

    q_extend [N, Hq, D], k_extend/v_extend [N, Hkv, D]: new tokens packed back to back, request b at
    rows qo_indptr[b]:qo_indptr[b+1]. Its cached prefix is at slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    of k_buffer/v_buffer [slots, Hkv, D]. max_len_extend bounds qo_indptr[b+1] - qo_indptr[b].
    With `sliding_window` W, a query sees only the keys less than W positions before it (the
    prefix is still given whole; the keys before the window are not read). With `kv_kind`
    (`KVFormat.kernel_kind`) the buffers hold quantized rows `[slots, Hkv, D + 4]` (codes, then
    a float32 scale), dequantized as read; the new tokens' k/v are floats either way.
    """
    _check_last_dim_contiguous(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer)
    batch = qo_indptr.numel() - 1
    num_heads, head_dim = q_extend.shape[1], q_extend.shape[2]
    num_kv_heads = k_extend.shape[1]
    assert num_heads % num_kv_heads == 0 and head_dim <= 256
    kind = check_kv_rows(k_buffer, head_dim, kv_kind)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if batch == 0 or max_len_extend == 0:
        return

    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg = _launch_config(block_d)
    grid = (batch, num_heads, triton.cdiv(max_len_extend, cfg["BLOCK_M"]))
    _extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o_extend.stride(0),
        o_extend.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        LOGIT_CAP=logit_cap,
        WINDOW=sliding_window or 0,
        DOT_PRECISION=dot_precision(q_extend.dtype),
        KV_KIND=kind,
        **cfg,
    )
