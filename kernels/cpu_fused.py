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

import torch

from . import native

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* Each op by rows, callable from any parallel region (`cpu_layer` calls them inside its own),
   and without fused multiply-adds wherever the library that holds them is built: each product
   rounds on its own, as torch's separate ops do. */
#define ROW_MATH __attribute__((optimize("fp-contract=off"))) static void

/* out = rmsnorm(x) * w over one row of H, or with residual: residual += x, out = rmsnorm(residual) * w. */
ROW_MATH norm_row(const float *in, float *residual, const float *w, float *out, int64_t H, float eps) {
    float *row = residual ? residual : (float *)in;
    if (residual)
        for (int64_t h = 0; h < H; h++) row[h] += in[h];
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int64_t h = 0; h < H; h++) sum += row[h] * row[h];
    const float r = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t h = 0; h < H; h++) out[h] = w[h] * (row[h] * r);
}

/* One token's qkv row [(Hq + 2 Hkv) D]: q rotated into q_out [Hq, D]; k rotated and v copied
   into the pool rows kdst, vdst [Hkv, D]; cos, sin [D]. */
ROW_MATH rope_row(const float *row, const float *c, const float *s, float *q_out, float *kdst,
                  float *vdst, int64_t Hq, int64_t Hkv, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
        const float *in = row + h * D;
        float *o = h < Hq ? q_out + h * D : kdst + (h - Hq) * D;
        for (int64_t d = 0; d < half; d++) {
            o[d] = in[d] * c[d] + (-in[d + half]) * s[d];
            o[d + half] = in[d + half] * c[d + half] + in[d] * s[d + half];
        }
    }
    for (int64_t d = 0; d < Hkv * D; d++) vdst[d] = row[(Hq + Hkv) * D + d];
}

/* One row of gate_up [2I] -> out [I] = silu(gate) * up. */
ROW_MATH silu_row(const float *g, float *out, int64_t I) {
    const float *u = g + I;
    for (int64_t i = 0; i < I; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out[t] = rmsnorm(x[t]) * w, or with residual: residual[t] += x[t]; out[t] = rmsnorm(residual[t]) * w. */
void rms_norm(const float *x, float *residual, const float *w, float *out, int64_t T, int64_t H,
              float eps) {
    #pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, residual ? residual + t * H : 0, w, out + t * H, H, eps);
}

/* qkv [T, (Hq + 2 Hkv) D]: q rotated into q_out [T, Hq, D]; k rotated and v copied into the
   pool rows k_buf/v_buf [slots[t]] (each [Hkv, D]); cos, sin [T, D]. */
void rope_store(const float *qkv, const float *cos, const float *sin, float *q_out, float *k_buf,
                float *v_buf, const int64_t *slots, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
    #pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++)
        rope_row(qkv + t * (Hq + 2 * Hkv) * D, cos + t * D, sin + t * D, q_out + t * Hq * D,
                 k_buf + slots[t] * Hkv * D, v_buf + slots[t] * Hkv * D, Hq, Hkv, D);
}

/* gate_up [T, 2I] -> out [T, I] = silu(gate) * up. */
void silu_mul(const float *gate_up, float *out, int64_t T, int64_t I) {
    #pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) silu_row(gate_up + t * 2 * I, out + t * I, I);
}
"""
P, I = native.POINTER, native.INT64
SIGNATURES = (
    ("rms_norm", (P,) * 4 + (I,) * 2 + (native.FLOAT,)),
    ("rope_store", (P,) * 7 + (I,) * 4),
    ("silu_mul", (P, P, I, I)),
)


def _library():
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
    _library().rms_norm(
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
    _library().rope_store(
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
    _library().silu_mul(gate_up.data_ptr(), out.data_ptr(), t, width // 2)
    return out
