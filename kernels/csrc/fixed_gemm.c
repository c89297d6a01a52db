/* kernels/fixed_gemm.py's kernel (its docstring says how and why). */
#include "avx2.h"
#define PANEL 16
#define MR 6
#define BLOCK_ROWS 48 /* rows of x walked past every panel at once: they stay in L2 */
#define AI __attribute__((always_inline))

/* MT rows (1..6) of x [., K] against one panel [K, 16]: out[i, n0 + j] for j < nn. Lanes of
   c<i>0 and c<i>1 are outputs (i, n0 .. n0 + 15): one FMA chain each over k in order. Named
   registers, not an array: gcc kept an array's chains in memory. */
#define ROW(i)                                               \
    if (MT > i) {                                            \
        const __m256 a = _mm256_broadcast_ss(x + i * K + k); \
        c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);           \
        c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);           \
    }
#define STORE(i)                                                     \
    if (MT > i) {                                                    \
        float v[PANEL];                                              \
        _mm256_storeu_ps(v, c##i##0);                                \
        _mm256_storeu_ps(v + 8, c##i##1);                            \
        for (int64_t j = 0; j < nn; j++) out[i * N + n0 + j] = v[j]; \
    }
static inline AI void tile(const float *x, int64_t K, const float *wp, float *out, int64_t N,
                           int64_t n0, int64_t nn, const int MT) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(wp + k * PANEL), w1 = _mm256_loadu_ps(wp + k * PANEL + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

/* out [M, N] = x [M, K] @ w.T, w packed [ceil(N/16), K, 16] (zero rows past N). Blocks of
   BLOCK_ROWS rows, each walked past every panel (the panels shared out over the threads), MR
   rows at a time. */
void fixed_linear(const float *x, const float *w, float *out, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += BLOCK_ROWS) {
        const int64_t m1 = m0 + BLOCK_ROWS < M ? m0 + BLOCK_ROWS : M;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
            const float *wp = w + p * K * PANEL;
            int64_t m = m0;
            for (; m + MR <= m1; m += MR) tile(x + m * K, K, wp, out + m * N, N, n0, nn, MR);
            switch (m1 - m) {
            case 5: tile(x + m * K, K, wp, out + m * N, N, n0, nn, 5); break;
            case 4: tile(x + m * K, K, wp, out + m * N, N, n0, nn, 4); break;
            case 3: tile(x + m * K, K, wp, out + m * N, N, n0, nn, 3); break;
            case 2: tile(x + m * K, K, wp, out + m * N, N, n0, nn, 2); break;
            case 1: tile(x + m * K, K, wp, out + m * N, N, n0, nn, 1); break;
            }
        }
    }
}
