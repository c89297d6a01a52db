/* kernels/int8_gemm.py's kernel (its docstring says how and why). */
#include "avx2.h"
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
static inline __attribute__((always_inline)) void
tile(const int16_t *xq, const float *xs, const int8_t *wt, const float *ws, const float *bias,
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
        for (; m + 3 <= M; m += 3)
            tile(xq + m * Kp, xs + m, wt, ws, bias, out + m * N, 3, N, Kp, n0, nn);
        if (M - m == 2) tile(xq + m * Kp, xs + m, wt, ws, bias, out + m * N, 2, N, Kp, n0, nn);
        if (M - m == 1) tile(xq + m * Kp, xs + m, wt, ws, bias, out + m * N, 1, N, Kp, n0, nn);
    }
}

void int8_linear(const float *x, int16_t *xq, float *xs, const int8_t *w, const float *ws,
                 const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t Kp) {
#pragma omp parallel
    int8_body(x, xq, xs, w, ws, bias, out, M, N, K, Kp);
}
