"""Weight-only grouped matrix multiply for the CPU (AVX2): `x @ dequant(w).T + bias`, with 4-bit
weights (`--quantization int4`, GGUF Q4_0/Q4_1) or 8-bit ones (GGUF Q8_0) in groups of 32 inputs.

A group of 32 weights of one output row is `w = d * q + m`: q unsigned 4-bit (0..15) with a
scale d and an offset m (asymmetric; symmetric is m = -8 d, which is how GGUF's Q4_0 reads), or
q signed 8-bit with m = 0 (Q8_0). d and m are float16, so a 4-bit weight costs 0.625 bytes, near
llama.cpp's Q4_0 (0.5625) and Q4_1 (0.625); the nibbles are in GGUF's own order (byte b holds
input b in its low half, input b + 16 in its high half), so GGUF blocks are copied in, never
re-rounded.

Why this shape: batch-1 decode on a CPU is the time to read the weights, so they are packed once
into tiles of 4 output rows x one group, in the order the kernel reads them (one sequential
stream per thread), with the tile's 4 scales and 4 offsets beside. Activations are quantized
per group to int8 on the fly (llama.cpp's Q8 activations, relative error about 1/254 of each
group's largest value), so one `vpmaddubsw` multiplies 32 weight-activation pairs; the offset's
share of a group is m times the activations' float sum, added once per group and row.

Int16 pair sums cannot overflow: |q| <= 15 (4-bit) or a sign-moved |q| <= 127 times |a| <= 127,
two per lane, is at most 32,258.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from . import native

ROWS, GROUP = 4, 32  # a tile: output rows x inputs (one group)

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

void int4_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *dm, const float *bias, float *out, int64_t M, int64_t N,
                 int64_t K, int64_t G) {
    grouped_linear(x, a, xs, xsum, w, dm, bias, out, M, N, K, G, 4);
}

void q8_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
               const uint16_t *dm, const float *bias, float *out, int64_t M, int64_t N,
               int64_t K, int64_t G) {
    grouped_linear(x, a, xs, xsum, w, dm, bias, out, M, N, K, G, 8);
}
"""
)
P, I = native.POINTER, native.INT64
SIGNATURES = (("int4_linear", (P,) * 8 + (I,) * 4), ("q8_linear", (P,) * 8 + (I,) * 4))


def _library():
    return native.load("int4_gemm", SOURCE, SIGNATURES)


def available() -> bool:
    """Whether this CPU runs the kernel (AVX2, a compiler to build it); builds it on first use."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and _library() is not None


class Bits(enum.IntEnum):
    """How a group's weights are stored: 16 bytes of nibbles, or 32 signed bytes."""

    INT4 = 4
    INT8 = 8

    @property
    def group_bytes(self) -> int:
        return GROUP * self // 8


@dataclass
class PackedGroups:
    """A weight [N, K] as tiles of 4 rows x 32 inputs and each tile's float16 scales and
    offsets; the kernel's arguments that never change are read once here rather than on every
    call. Built by `quantize` (from float weights) or `from_blocks` (GGUF's blocks, as stored)."""

    tiles: torch.Tensor  # uint8 [ceil(N/4), G, 4, group bytes], G = ceil(K/32)
    scales: torch.Tensor  # float16 [ceil(N/4), G, 8]: the 4 rows' d, then their m
    out_features: int
    in_features: int
    bits: Bits
    groups: int = field(init=False)
    tiles_ptr: int = field(init=False)
    scales_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.tiles.is_contiguous() and self.scales.is_contiguous()
        self.groups = self.tiles.shape[1]
        self.tiles_ptr, self.scales_ptr = self.tiles.data_ptr(), self.scales.data_ptr()

    @property
    def nbytes(self) -> int:
        """Bytes a multiply reads: the packed weights, scales and offsets."""
        return self.tiles.nbytes + self.scales.nbytes

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bits: Bits = Bits.INT4, symmetric: bool = False
    ) -> PackedGroups:
        """Groups of 32 by round-to-nearest. 4-bit asymmetric spans each group's [min, max]
        with 16 levels; 4-bit symmetric is GGUF's Q4_0 rule (the largest magnitude maps to -8,
        so q - 8 covers [-8, 7] d); 8-bit is Q8_0's (symmetric, q in [-127, 127])."""
        n, k = weight.shape
        groups = -(-k // GROUP)
        w = torch.zeros(n, groups * GROUP)
        w[:, :k] = weight.detach().float()
        w = w.view(n, groups, GROUP)
        if bits == Bits.INT8:
            d = (w.abs().amax(dim=2) / 127).half()
            inv = torch.where(d == 0, 0.0, 1 / d.float())
            q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
            return cls.from_blocks(q, d, None, k, bits)
        if symmetric:
            top = w.gather(2, w.abs().argmax(dim=2, keepdim=True)).squeeze(2)
            d = (top / -8).half()
            m = (-8 * d.float()).half()
        else:
            low, high = w.amin(dim=2), w.amax(dim=2)
            d, m = ((high - low) / 15).half(), low.half()
        inv = torch.where(d == 0, 0.0, 1 / d.float())
        q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        return cls.from_blocks(nibbles, d, m, k, bits)

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, in_features: int, bits: Bits
    ) -> PackedGroups:
        """Rows of blocks as GGUF stores them: q [N, G, group bytes] (nibbles in GGUF's order,
        or int8 values viewed as uint8), d and m float16 [N, G] (m None: zero)."""
        n, groups = d.shape
        np_ = -(-n // ROWS) * ROWS
        padded = torch.zeros(np_, groups, bits.group_bytes, dtype=torch.uint8)
        padded[:n] = q.view(torch.uint8)
        scales = torch.zeros(np_, groups, 2, dtype=torch.float16)
        scales[:n, :, 0] = d
        if m is not None:
            scales[:n, :, 1] = m
        tiles = padded.view(np_ // ROWS, ROWS, groups, -1).transpose(1, 2).contiguous()
        scales = scales.view(np_ // ROWS, ROWS, groups, 2).permute(0, 2, 3, 1).contiguous()
        return cls(tiles, scales.view(np_ // ROWS, groups, 2 * ROWS), n, in_features, bits)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for."""
        t, groups = self.tiles.shape[:2]
        q = self.tiles.transpose(1, 2).reshape(t * ROWS, groups, -1)
        if self.bits == Bits.INT4:
            q = torch.cat([q & 0x0F, q >> 4], dim=2)
        else:
            q = q.view(torch.int8)
        sc = self.scales.float().view(t, groups, 2, ROWS).permute(0, 3, 1, 2).reshape(-1, groups, 2)
        w = q.float() * sc[..., :1] + sc[..., 1:]
        return w.reshape(t * ROWS, -1)[: self.out_features, : self.in_features]


def grouped_linear(x: torch.Tensor, w: PackedGroups, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32. Lean on purpose, like `int8_gemm.int8_linear`: at
    batch 1 this wrapper's own microseconds add up over every linear of a step."""
    x = x.contiguous()
    m, groups = x.shape[0], w.groups
    a = torch.empty(m, groups * GROUP, dtype=torch.int8)
    xs = torch.empty(m, groups, dtype=torch.float32)
    xsum = torch.empty(m, groups, dtype=torch.float32)
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    run = _library().int4_linear if w.bits == Bits.INT4 else _library().q8_linear
    run(
        x.data_ptr(),
        a.data_ptr(),
        xs.data_ptr(),
        xsum.data_ptr(),
        w.tiles_ptr,
        w.scales_ptr,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        w.out_features,
        w.in_features,
        groups,
    )
    return out
