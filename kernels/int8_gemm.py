"""Weight-only int8 matrix multiply for the CPU (AVX2; AVX-512 VNNI): `x @ (w * scale).T + bias`.

Weights are int8, symmetric, one scale per output channel. Each activation row is quantized on
the fly to int16 with its own scale (relative error about 1.5e-5 of the row's largest value, far
below the weights' own rounding), so the products run on integer multiply-adds (`vpmaddwd`: 16
per instruction) instead of converting every weight to float.

Why a kernel of our own: the int8 routes torch offers on this kind of CPU were slower than
float32 or failed the quality gates (docs/benchmarks/history.md, "int8 weights: the candidates measured"). What makes a decode
step fast is reading the weights at the memory's speed, so they are packed once into tiles of
4 output rows x 32 inputs, laid out in the order the kernel reads them: one sequential stream per
thread. A tile stays in L1 while every block of 3 activation rows passes over it, so prefill
chunks reuse it from cache too.

Int32 sums cannot overflow: |x| <= 32767, |w| <= 127 and at most 2,048 inputs are summed in int32
before being added to a float accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import cpu_isa, native

ROWS, DEPTH = 4, 32  # a tile: output rows x inputs
QUANTIZE_BYTES = 4 << 20  # float weights `PackedInt8.quantize` rounds at a time

SOURCE = (
    native.AVX2_PRELUDE
    + r"""
#include <math.h>

#define ROWS 4
#define DEPTH 32
#define SPAN 2048 /* inputs summed in int32 before a flush to float */

/* Row m of x [M, K] -> int16 q [Kp] (zero past K) and its scale: x ~= q * scale. */
static void quantize_row16(const float *row, int16_t *q, float *scale, int64_t K, int64_t Kp) {
    float top = 0.0f;
    for (int64_t k = 0; k < K; k++) top = fmaxf(top, fabsf(row[k]));
    const float s = top > 0.0f ? top / 32767.0f : 1.0f, inv = 1.0f / s;
    for (int64_t k = 0; k < K; k++) q[k] = (int16_t)lrintf(row[k] * inv);
    for (int64_t k = K; k < Kp; k++) q[k] = 0;
    *scale = s;
}

/* MT activation rows (1..3) against one packed tile row of 4 outputs. */
static inline __attribute__((always_inline)) void tile(
        const int16_t *xq, const float *xs, const int8_t *wt, const float *ws, const float *bias,
        float *out, int64_t MT, int64_t N, int64_t Kp, int64_t n0, int64_t nn) {
    __m256 total[3][ROWS];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < ROWS; j++) total[i][j] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < Kp; k0 += SPAN) {
        const int64_t k1 = k0 + SPAN < Kp ? k0 + SPAN : Kp;
        __m256i acc[3][ROWS];
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < ROWS; j++) acc[i][j] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += DEPTH) {
            const int8_t *chunk = wt + k * ROWS;
            _mm_prefetch((const char *)(chunk + 1024), _MM_HINT_T0);
            _mm_prefetch((const char *)(chunk + 1088), _MM_HINT_T0);
            for (int j = 0; j < ROWS; j++) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(chunk + DEPTH * j));
                const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
                const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
                for (int i = 0; i < MT; i++) {
                    const int16_t *xr = xq + i * Kp + k;
                    const __m256i a0 = _mm256_loadu_si256((const __m256i *)xr);
                    const __m256i a1 = _mm256_loadu_si256((const __m256i *)(xr + 16));
#ifdef VNNI /* vpdpwssd: the pairs' products added in the same instruction, the same sums */
                    acc[i][j] = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(acc[i][j], a0, lo), a1, hi);
#else
                    acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(a0, lo));
                    acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(a1, hi));
#endif
                }
            }
        }
        for (int i = 0; i < MT; i++)
            for (int j = 0; j < ROWS; j++)
                total[i][j] = _mm256_add_ps(total[i][j], _mm256_cvtepi32_ps(acc[i][j]));
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < nn; j++)
            out[i * N + n0 + j] =
                hsum8(total[i][j]) * xs[i] * ws[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
}

/* out [M, N] = x @ dequant(w).T + bias, x [M, K] float; w packed [ceil(N/4), Kp/32, 4, 32];
   xq [M, Kp] and xs [M]: scratch for the quantized rows. Called by every thread of one parallel
   region (`cpu_layer` calls it inside its own): the rows, then the tiles, no barrier after. */
static void int8_body(const float *x, int16_t *xq, float *xs, const int8_t *w, const float *ws,
                      const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t Kp) {
    const int64_t tiles = (N + ROWS - 1) / ROWS;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row16(x + m * K, xq + m * Kp, xs + m, K, Kp);
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * ROWS, nn = N - n0 < ROWS ? N - n0 : ROWS;
        const int8_t *wt = w + t * ROWS * Kp;
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) tile(xq + m * Kp, xs + m, wt, ws, bias, out + m * N, 3, N, Kp, n0, nn);
        if (M - m == 2) tile(xq + m * Kp, xs + m, wt, ws, bias, out + m * N, 2, N, Kp, n0, nn);
        if (M - m == 1) tile(xq + m * Kp, xs + m, wt, ws, bias, out + m * N, 1, N, Kp, n0, nn);
    }
}

void int8_linear(const float *x, int16_t *xq, float *xs, const int8_t *w, const float *ws,
                 const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t Kp) {
    #pragma omp parallel
    int8_body(x, xq, xs, w, ws, bias, out, M, N, K, Kp);
}
"""
)
P, I = native.POINTER, native.INT64
SIGNATURES = (("int8_linear", (P,) * 7 + (I,) * 4),)


def _library(isa: cpu_isa.Isa = cpu_isa.Isa.AVX2):
    return native.load(f"int8_gemm-{isa.value}", SOURCE, SIGNATURES, isa.cflags)


def available(isa: cpu_isa.Isa = cpu_isa.Isa.AVX2) -> bool:
    """Whether this CPU runs the kernel on `isa` (the CPU has it, a compiler builds it);
    builds it on first use."""
    return isa in cpu_isa.host_paths() and _library(isa) is not None


@dataclass
class PackedInt8:
    """A weight [N, K] as int8 tiles and per-output-channel float scales; the kernel's
    arguments that never change are read once here rather than on every call."""

    tiles: torch.Tensor  # int8 [ceil(N/4), Kp/32, 4, 32], Kp = K rounded up to 32
    scales: torch.Tensor  # float32 [N]
    out_features: int
    in_features: int
    padded_in_features: int = field(init=False)  # Kp
    tiles_ptr: int = field(init=False)
    scales_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.tiles.is_contiguous() and self.scales.is_contiguous()
        self.padded_in_features = self.tiles.shape[1] * DEPTH
        self.tiles_ptr, self.scales_ptr = self.tiles.data_ptr(), self.scales.data_ptr()

    def to(self, device: torch.device) -> PackedInt8:
        """The same packing on `device` (a GPU's Triton kernel reads it as stored)."""
        return replace(self, tiles=self.tiles.to(device), scales=self.scales.to(device))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> PackedInt8:
        """Symmetric per-channel rounding: w ~= q * scale with q in [-127, 127]. Rows are
        rounded and packed `QUANTIZE_BYTES` of float at a time, straight into the result (rows
        round independently: the same result as in one pass, with small temporaries), on the
        CPU, wherever `weight` lies."""
        n, k = weight.shape
        kp = -(-k // DEPTH) * DEPTH
        tiles = torch.empty(-(-n // ROWS), kp // DEPTH, ROWS, DEPTH, dtype=torch.int8)
        scales = torch.empty(n)
        step = max(1, QUANTIZE_BYTES // (kp * 4 * ROWS)) * ROWS
        for start in range(0, n, step):
            w = weight[start : start + step].detach().to("cpu", torch.float32)
            part = scales[start : start + step]
            torch.clamp_min(w.abs().amax(dim=1) / 127, torch.finfo(torch.float32).tiny, out=part)
            q = torch.round(w / part[:, None]).clamp_(-127, 127).to(torch.int8)
            packed = pack(q)
            tiles[start // ROWS : start // ROWS + packed.shape[0]] = packed
        return cls(tiles, scales, n, k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for."""
        q = self.tiles.permute(0, 2, 1, 3).reshape(-1, self.padded_in_features)
        return q[: self.out_features, : self.in_features].float() * self.scales[:, None]


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> tiles [ceil(N/4), Kp/32, 4, 32], zero-padded, in the kernel's read order."""
    n, k = q.shape
    np_, kp = -(-n // ROWS) * ROWS, -(-k // DEPTH) * DEPTH
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = q
    return padded.view(np_ // ROWS, ROWS, kp // DEPTH, DEPTH).transpose(1, 2).contiguous()


def int8_linear(
    x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None, isa: cpu_isa.Isa = cpu_isa.Isa.AVX2
) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32, on `isa`'s kernel (every path gives the same
    bits). Lean on purpose: at batch 1 this wrapper's own microseconds, times four linears a
    layer, are a visible share of a decode step."""
    x = x.contiguous()
    m, kp = x.shape[0], w.padded_in_features
    xq = torch.empty(m, kp, dtype=torch.int16)
    xs = torch.empty(m, dtype=torch.float32)
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    _library(isa).int8_linear(
        x.data_ptr(),
        xq.data_ptr(),
        xs.data_ptr(),
        w.tiles_ptr,
        w.scales_ptr,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        w.out_features,
        w.in_features,
        kp,
    )
    return out
