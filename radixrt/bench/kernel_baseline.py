"""The int4 kernel as it was before the lane-interleaved panels (`kernels/int4_gemm.py`), kept
as `radixrt bench --workload kernels`' baseline: tiles of 4 output rows x one group, each row's
sums in its own vector and folded by three `vphaddd` per activation row and group, the weights
unpacked again for every 4 activation rows. Served nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.kernels import native
from radixrt.kernels.int4_gemm import GROUP, Bits, PackedGroups

ROWS = 4

SOURCE = (
    native.AVX2_PRELUDE
    + r"""
#include <math.h>

#define ROWS 4
#define GROUP 32
#define MT_MAX 4 /* activation rows per pass over a tile */

/* x row [K] -> int8 a [G * 32] (zero past K), each group's scale xs [G] and float sum xsum [G]. */
static void quantize_row(const float *row, int8_t *a, float *xs, float *xsum, int64_t K, int64_t G) {
    for (int64_t g = 0; g < G; g++) {
        const int64_t k0 = g * GROUP, n = K - k0 < GROUP ? K - k0 : GROUP;
        float top = 0.0f, sum = 0.0f;
        for (int64_t k = 0; k < n; k++) {
            top = fmaxf(top, fabsf(row[k0 + k]));
            sum += row[k0 + k];
        }
        const float s = top > 0.0f ? top / 127.0f : 1.0f, inv = 1.0f / s;
        for (int64_t k = 0; k < n; k++) a[k0 + k] = (int8_t)lrintf(row[k0 + k] * inv);
        for (int64_t k = n; k < GROUP; k++) a[k0 + k] = 0;
        xs[g] = s;
        xsum[g] = sum;
    }
}

/* The 32 weights of one tile row and group as bytes: 4-bit nibbles to 0..15, 8-bit as stored. */
static inline __attribute__((always_inline)) __m256i unpack(const uint8_t *w, int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)w);
    const __m128i b = _mm_loadu_si128((const __m128i *)w);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

/* 8 int32 partial sums of q . a over a group: 4-bit q is unsigned already; signed 8-bit q is
   made unsigned (|q|) with its sign moved onto the activation. */
static inline __attribute__((always_inline)) __m256i dot32(__m256i q, __m256i a, int bits) {
    const __m256i p = bits == 4 ? _mm256_maddubs_epi16(q, a)
                                : _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* MT activation rows (1..MT_MAX) against one tile row of 4 outputs, every group. A group's
   4 row sums are folded into one vector (lanes j and j + 4: row j's halves) before one convert
   and one multiply-add by the rows' scales: fewer instructions than one per row. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *a, const float *xs, const float *xsum, const uint8_t *wt, const uint16_t *dm,
        const float *bias, float *out, int64_t MT, int64_t N, int64_t G, int64_t n0, int64_t nn,
        int bits) {
    const int64_t wbytes = bits == 4 ? 16 : 32, Kp = G * GROUP;
    __m256 acc[MT_MAX];
    __m128 offset[MT_MAX];
    for (int i = 0; i < MT_MAX; i++) {
        offset[i] = _mm_setzero_ps();
        acc[i] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *chunk = wt + g * ROWS * wbytes;
        _mm_prefetch((const char *)(chunk + 16 * ROWS * wbytes), _MM_HINT_T0);
        /* lanes 0..3: the rows' scales d, 4..7: their offsets m */
        const __m256 dmf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + g * 2 * ROWS)));
        const __m256 dd = _mm256_permute2f128_ps(dmf, dmf, 0x00);
        __m256i w[ROWS];
        for (int j = 0; j < ROWS; j++) w[j] = unpack(chunk + wbytes * j, bits);
        for (int i = 0; i < MT; i++) {
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a + i * Kp + g * GROUP));
            const __m256i s = _mm256_hadd_epi32(
                _mm256_hadd_epi32(dot32(w[0], av, bits), dot32(w[1], av, bits)),
                _mm256_hadd_epi32(dot32(w[2], av, bits), dot32(w[3], av, bits)));
            acc[i] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(s), _mm256_mul_ps(dd, _mm256_set1_ps(xs[i * G + g])), acc[i]);
            offset[i] = _mm_fmadd_ps(
                _mm256_extractf128_ps(dmf, 1), _mm_set1_ps(xsum[i * G + g]), offset[i]);
        }
    }
    for (int i = 0; i < MT; i++) {
        float m[4], v[8];
        _mm_storeu_ps(m, offset[i]);
        _mm256_storeu_ps(v, acc[i]);
        for (int j = 0; j < nn; j++)
            out[i * N + n0 + j] = v[j] + v[j + 4] + m[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* out [M, N] = x @ dequant(w).T + bias, x [M, K] float; w packed [ceil(N/4), G, 4, bytes of a
   group]; dm float16 [ceil(N/4), G, 8] (4 scales, 4 offsets); a [M, G * 32], xs and xsum [M, G]:
   scratch for the quantized rows. One parallel region: rows, then tiles. */
static inline __attribute__((always_inline)) void grouped_linear(
        const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w, const uint16_t *dm,
        const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t G, int bits) {
    const int64_t tiles = (N + ROWS - 1) / ROWS, wbytes = bits == 4 ? 16 : 32;
    #pragma omp parallel
    {
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, a + m * G * GROUP, xs + m * G, xsum + m * G, K, G);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * ROWS, nn = N - n0 < ROWS ? N - n0 : ROWS;
        const uint8_t *wt = w + t * G * ROWS * wbytes;
        const uint16_t *dt = dm + t * G * 2 * ROWS;
        int64_t m = 0;
        for (; m + MT_MAX <= M; m += MT_MAX)
            tile(a + m * G * GROUP, xs + m * G, xsum + m * G, wt, dt, bias, out + m * N, MT_MAX, N,
                 G, n0, nn, bits);
        /* the rest, with the row count a constant so that each case compiles to its own loop */
        const int8_t *ar = a + m * G * GROUP;
        const float *xr = xs + m * G, *sr = xsum + m * G;
        float *o = out + m * N;
        switch (M - m) {
        case 1: tile(ar, xr, sr, wt, dt, bias, o, 1, N, G, n0, nn, bits); break;
        case 2: tile(ar, xr, sr, wt, dt, bias, o, 2, N, G, n0, nn, bits); break;
        case 3: tile(ar, xr, sr, wt, dt, bias, o, 3, N, G, n0, nn, bits); break;
        }
    }
    }
}

void tile4_int4_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *dm, const float *bias, float *out, int64_t M, int64_t N,
                 int64_t K, int64_t G) {
    grouped_linear(x, a, xs, xsum, w, dm, bias, out, M, N, K, G, 4);
}

void tile4_q8_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
               const uint16_t *dm, const float *bias, float *out, int64_t M, int64_t N,
               int64_t K, int64_t G) {
    grouped_linear(x, a, xs, xsum, w, dm, bias, out, M, N, K, G, 8);
}
"""
)
P, INT = native.POINTER, native.INT64
SIGNATURES = (
    ("tile4_int4_linear", (P,) * 8 + (INT,) * 4),
    ("tile4_q8_linear", (P,) * 8 + (INT,) * 4),
)


@dataclass
class Tile4Weight:
    """A `PackedGroups` weight in the old layout: [ceil(N/4), G, 4, group bytes] and float16
    [ceil(N/4), G, 8] (the 4 rows' d, then their m)."""

    tiles: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    bits: Bits

    @classmethod
    def of(cls, w: PackedGroups) -> Tile4Weight:
        q, d, m = w.blocks()
        n, groups = d.shape
        np_ = -(-n // ROWS) * ROWS
        padded = torch.zeros(np_, groups, w.bits.group_bytes, dtype=torch.uint8)
        padded[:n] = q
        scales = torch.zeros(np_, groups, 2, dtype=torch.float16)
        scales[:n, :, 0], scales[:n, :, 1] = d, m
        tiles = padded.view(np_ // ROWS, ROWS, groups, -1).transpose(1, 2).contiguous()
        scales = scales.view(np_ // ROWS, ROWS, groups, 2).permute(0, 2, 3, 1).contiguous()
        return cls(tiles, scales.view(np_ // ROWS, groups, 2 * ROWS), n, w.in_features, w.bits)


def tile4_linear(x: torch.Tensor, w: Tile4Weight) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 by the old kernel (no bias)."""
    lib = native.load("int4_gemm_tile4", SOURCE, SIGNATURES)
    m, groups = x.shape[0], w.tiles.shape[1]
    a = torch.empty(m, groups * GROUP, dtype=torch.int8)
    xs, xsum = torch.empty(m, groups), torch.empty(m, groups)
    out = torch.empty(m, w.out_features)
    run = lib.tile4_int4_linear if w.bits == Bits.INT4 else lib.tile4_q8_linear
    run(
        x.data_ptr(),
        a.data_ptr(),
        xs.data_ptr(),
        xsum.data_ptr(),
        w.tiles.data_ptr(),
        w.scales.data_ptr(),
        None,
        out.data_ptr(),
        m,
        w.out_features,
        w.in_features,
        groups,
    )
    return out
