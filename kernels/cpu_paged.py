"""Decode attention that reads K/V where they lie in the paged pool (CPU, float32 or quantized).

The torch path gathers each request's keys and values out of the pool into a padded tensor every
step, then attends over the copy: a decode step's memory traffic is the context copied, written
and read again. This kernel walks each request's slot list and reads every K/V row once, in place,
with an online softmax: scores as vector dot products (a key row serves all query heads of its KV
head), exponentials eight at a time. One OpenMP task per (request, KV head, key range); a small
batch's long contexts are cut into ranges so every core has work. It returns the log-sum-exp too,
for the cascade merge with the shared prefix.

A quantized pool (`--kv-cache-dtype`: rows of one-byte codes and a float32 scale per token and
KV head) takes the same entry, tasks and merge (`kind` names its codes), each key and value
row decoded to floats as it is read (int8, or FP8 E4M3/E5M2 through the F16C half conversion),
so a long context reads a quarter of float32's bytes; `quantize_int8` writes such rows.

Plain C built on first use (`native`). Without a compiler the backend keeps the gather path
(`supports()` says which).
"""

from __future__ import annotations

import ctypes

import torch

from . import native

SOURCE = native.CSRC / "cpu_paged.c"

MAX_GROUP, MAX_DIM = 16, 256
P, I = native.POINTER, native.INT64
SIGNATURES = (
    ("paged_decode", (P,) * 7 + (I,) * 5 + (native.FLOAT, native.FLOAT, I, P, I)),
    ("quantize_int8", (P,) * 3 + (I,) * 3),
)
FLOAT_ROWS = -1  # the C entry's `kind` for a float32 pool
MAX_SPLITS = 8
MIN_SPLIT_KEYS = 256  # a range shorter than this costs more to merge than it saves


def _library() -> ctypes.CDLL | None:
    return native.load("paged_decode", SOURCE, SIGNATURES)


def supports(k_buf: torch.Tensor) -> bool:
    """Whether decodes over this pool buffer can run in place (float32 on the CPU, a head size
    the kernel takes, a compiler to build it); builds the kernel on first use."""
    return (
        k_buf.device.type == "cpu"
        and k_buf.dtype == torch.float32
        and k_buf.shape[2] <= MAX_DIM
        and _library() is not None
    )


def supports_quantized(k_buf: torch.Tensor, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether decodes over this quantized pool buffer (`int8 [S, Hkv, head_dim + 4]`, read in
    `dtype`) can run in place: float32 queries on the CPU, a head size the kernel takes (a
    multiple of 8), a compiler to build it."""
    return (
        k_buf.device.type == "cpu"
        and k_buf.dtype == torch.int8
        and dtype == torch.float32
        and head_dim <= MAX_DIM
        and head_dim % 8 == 0
        and k_buf.shape[2] == head_dim + 4
        and _library() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    logit_cap: float | None = None,
    splits: int | None = None,
    kind: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] over the keys `slots[b, :lens[b]]` of the pool -> out [B, Hq, D] and the
    log-sum-exp of the scaled scores [B, Hq] (-inf and zeros for a request with no keys); with
    `logit_cap` the scores are soft-capped first (cap * tanh(score / cap)). `splits`: key ranges
    per (request, KV head), chosen by the batch and thread count when None; 1 makes each row's
    sum independent of both (the deterministic mode). `kind`: a quantized pool's codes
    (`KVFormat.kernel_kind`), its rows `int8 [S, Hkv, D + 4]` each dequantized as it is read;
    None for float32 rows."""
    b, hq, d = q.shape
    q, slots, lens = q.contiguous(), slots.contiguous(), lens.contiguous()
    assert k_buf.is_contiguous() and v_buf.is_contiguous()
    assert slots.dtype == lens.dtype == torch.int64
    assert kind is None or k_buf.shape[2] == d + 4, "a quantized row is D codes and a scale"
    hkv = k_buf.shape[1]
    splits = splits or choose_splits(b * hkv, slots.shape[1])
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, dtype=torch.float32)
    part = torch.empty(b * hkv * splits * (hq // hkv) * (d + 2), dtype=torch.float32)
    args = [
        q.data_ptr(),
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        b,
        hq,
        hkv,
        d,
        slots.shape[1],
        d**-0.5,
        logit_cap or 0.0,
        splits,
        part.data_ptr(),
    ]
    native.built(_library()).paged_decode(*args, FLOAT_ROWS if kind is None else kind)
    return out, lse


def quantize_int8(x: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write float rows x [T, H, D] into the int8 pool buffer [S, H, D + 4] at `slots` [T]
    (int64), quantized: the same bytes as `KVFormat.INT8.quantize`, in one call."""
    x, slots = x.contiguous(), slots.contiguous()
    t, h, d = x.shape
    assert x.dtype == torch.float32 and buf.dtype == torch.int8 and buf.shape[1:] == (h, d + 4)
    assert slots.dtype == torch.int64 and buf.is_contiguous()
    native.built(_library()).quantize_int8(x.data_ptr(), slots.data_ptr(), buf.data_ptr(), t, h, d)


def choose_splits(tasks: int, longest: int) -> int:
    """Key ranges per (request, KV head): enough tasks for two per thread, none shorter than
    MIN_SPLIT_KEYS."""
    wanted = -(-2 * torch.get_num_threads() // tasks)
    return max(1, min(MAX_SPLITS, wanted, longest // MIN_SPLIT_KEYS))
