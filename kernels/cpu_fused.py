"""The glue between a decoder layer's matmuls, fused for the CPU (float32): RMSNorm with the
residual add, rotary embedding with the K/V store into the pool, and SiLU-and-multiply.

At small batches a decode step's time outside the matmuls is per-op overhead, not arithmetic:
in torch these are about fifteen ATen calls a layer (the norm alone is five), each costing
microseconds of dispatch and a temporary, for a few thousand floats. One C call each does the
same arithmetic in the same order (float32, the residual added before the norm, HF's
`rotate_half` convention) with no temporaries. Built on first use (`native`); where it cannot
be built the model keeps its torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

SOURCE = native.CSRC / "cpu_fused.c"
P, I = native.POINTER, native.INT64
SIGNATURES = (
    ("rms_norm", (P,) * 4 + (I,) * 2 + (native.FLOAT,)),
    ("rope_store", (P,) * 7 + (I,) * 4),
    ("silu_mul", (P, P, I, I)),
)


def _library() -> ctypes.CDLL | None:
    return native.load("cpu_fused", SOURCE, SIGNATURES)


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops take this activation (float32 on the CPU, the library built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _library() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of `x` [T, H], or, given `residual`, `residual += x` in place and its RMSNorm."""
    x = x.contiguous()
    assert residual is None or residual.is_contiguous()
    out = torch.empty_like(x)
    native.built(_library()).rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
    )
    return out


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The fused qkv projection [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v are
    written to the pool buffers [S, Hkv, D] at `slots` [T] (int64). cos, sin: [T, D]."""
    t = qkv.shape[0]
    hkv, d = k_buf.shape[1], k_buf.shape[2]
    assert qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * hkv) * d
    assert cos.is_contiguous() and sin.is_contiguous() and slots.dtype == torch.int64
    slots = slots.contiguous()
    q = qkv.new_empty(t, num_heads, d)
    native.built(_library()).rope_store(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        slots.data_ptr(),
        t,
        num_heads,
        hkv,
        d,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    gate_up = gate_up.contiguous()
    t, width = gate_up.shape
    out = gate_up.new_empty(t, width // 2)
    native.built(_library()).silu_mul(gate_up.data_ptr(), out.data_ptr(), t, width // 2)
    return out
