"""Decode attention that reads K/V where they lie in the paged pool (CPU, float32).

The torch path gathers each request's keys and values out of the pool into a padded tensor every
step, then attends over the copy: a decode step's memory traffic is the context copied, written
and read again. This kernel walks each request's slot list and reads every K/V row once, in place,
with an online softmax; one OpenMP task per (request, KV head) serves all query heads of that KV
head. It returns the log-sum-exp too, for the cascade merge with the shared prefix.

Plain C built on first use (`native`). Without a compiler the backend keeps the gather path
(`supports()` says which).
"""

from __future__ import annotations

import torch

from . import native

SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define BLOCK 32

/* q [B, Hq, D]; k, v [S, Hkv, D]; slots [B, L]; lens [B]; out [B, Hq, D]; lse [B, Hq].
   Keys go in blocks of BLOCK: the block's K rows are copied transposed into a tile that stays in
   L1, so the scores of all query heads of the KV head are vector FMAs across keys; one rescale
   of the accumulators per block; then the values, vector FMAs across the head dimension. */
void paged_decode(const float *q, const float *k, const float *v, const int64_t *slots,
                  const int64_t *lens, float *out, float *lse, int64_t B, int64_t Hq, int64_t Hkv,
                  int64_t D, int64_t L, float scale) {
    const int64_t G = Hq / Hkv;
    #pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hkv; h++) {
            float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM];
            float kt[MAX_DIM][BLOCK], s[MAX_GROUP][BLOCK];
            const float *qh = q + (b * Hq + h * G) * D;
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
            }
            for (int64_t start = 0; start < lens[b]; start += BLOCK) {
                const int64_t n = lens[b] - start < BLOCK ? lens[b] - start : BLOCK;
                const int64_t *rows = slots + b * L + start;
                for (int64_t j = 0; j < n; j++) {
                    const float *kr = k + (rows[j] * Hkv + h) * D;
                    for (int64_t d = 0; d < D; d++) kt[d][j] = kr[d];
                }
                for (int64_t j = n; j < BLOCK; j++)
                    for (int64_t d = 0; d < D; d++) kt[d][j] = 0.0f;
                for (int64_t g = 0; g < G; g++) {
                    float sg[BLOCK] = {0};
                    const float *qg = qh + g * D;
                    for (int64_t d = 0; d < D; d++) {
                        const float qd = qg[d] * scale;
                        #pragma omp simd
                        for (int64_t j = 0; j < BLOCK; j++) sg[j] += qd * kt[d][j];
                    }
                    float block_max = m[g];
                    for (int64_t j = 0; j < n; j++) block_max = sg[j] > block_max ? sg[j] : block_max;
                    const float correction = expf(m[g] - block_max);
                    float sum = 0.0f;
                    for (int64_t j = 0; j < n; j++) {
                        s[g][j] = expf(sg[j] - block_max);
                        sum += s[g][j];
                    }
                    l[g] = l[g] * correction + sum;
                    m[g] = block_max;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= correction;
                }
                for (int64_t j = 0; j < n; j++) {
                    const float *vr = v + (rows[j] * Hkv + h) * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float p = s[g][j];
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) acc[g][d] += p * vr[d];
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (b * Hq + h * G + g) * D;
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
                lse[b * Hq + h * G + g] = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
            }
        }
    }
}
"""
MAX_GROUP, MAX_DIM = 16, 256
P, I = native.POINTER, native.INT64
SIGNATURES = (("paged_decode", (P,) * 7 + (I,) * 5 + (native.FLOAT,)),)


def _library():
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


def paged_decode(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] over the keys `slots[b, :lens[b]]` of the pool -> out [B, Hq, D] and the
    log-sum-exp of the scaled scores [B, Hq] (-inf for a request with no keys)."""
    b, hq, d = q.shape
    q, slots, lens = q.contiguous(), slots.contiguous(), lens.contiguous()
    assert (
        k_buf.is_contiguous() and v_buf.is_contiguous() and slots.dtype == lens.dtype == torch.int64
    )
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, dtype=torch.float32)
    _library().paged_decode(
        q.data_ptr(),
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        b,
        hq,
        k_buf.shape[1],
        d,
        slots.shape[1],
        d**-0.5,
    )
    return out, lse
