"""Float32 matrix multiply whose every output is summed in one fixed order, whatever the number
of rows (`--enable-deterministic-inference`, CPU, AVX2): `x @ w.T`.

oneDNN and MKL pick their kernel, blocking and K-split by the number of rows M, so one row's
result moves in its last bits with the batch it is computed in, how much of its prompt came from
the cache (the prefill's M) and the prefill chunk size. Here output (m, n) is always one chain of
fused multiply-adds over k = 0, 1, ..., K - 1 from zero, in one 32-bit lane: weights are packed in
panels of 16 output rows interleaved by lane (`pack`: for each k, the 16 rows' weights side by
side), an activation x[m, k] is broadcast to every lane, and a register tile of up to 6 rows x 16
outputs holds twelve independent chains. Tiling over M and N, and which thread runs a panel,
change what runs together, never an output's order. The tile keeps prefill near oneDNN's speed
and a decode row reads each panel once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cpu_isa, native

PANEL = 16  # output rows of a panel: two AVX2 vectors

SOURCE = (
    native.AVX2_PRELUDE
    + r"""
#define PANEL 16
#define MR 6
#define BLOCK_ROWS 48 /* rows of x walked past every panel at once: they stay in L2 */
#define AI __attribute__((always_inline))

/* MT rows (1..6) of x [., K] against one panel [K, 16]: out[i, n0 + j] for j < nn. Lanes of
   c<i>0 and c<i>1 are outputs (i, n0 .. n0 + 15): one FMA chain each over k in order. Named
   registers, not an array: gcc kept an array's chains in memory. */
#define ROW(i)                                                             \
    if (MT > i) {                                                          \
        const __m256 a = _mm256_broadcast_ss(x + i * K + k);               \
        c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);                         \
        c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);                         \
    }
#define STORE(i)                                                           \
    if (MT > i) {                                                          \
        float v[PANEL];                                                    \
        _mm256_storeu_ps(v, c##i##0);                                      \
        _mm256_storeu_ps(v + 8, c##i##1);                                  \
        for (int64_t j = 0; j < nn; j++) out[i * N + n0 + j] = v[j];       \
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
"""
)
SIGNATURES = (("fixed_linear", (native.POINTER,) * 3 + (native.INT64,) * 3),)


def _library():
    return native.load("fixed_gemm", SOURCE, SIGNATURES)


def available() -> bool:
    """Whether this CPU runs the kernel (AVX2, a compiler to build it); builds it on first use."""
    return cpu_isa.Isa.AVX2 in cpu_isa.host_paths() and _library() is not None


@dataclass
class PackedPanels:
    """A float32 weight [N, K] in panels of 16 output rows, lane-interleaved: [ceil(N/16), K, 16]."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    panels_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.panels.is_contiguous() and self.panels.dtype == torch.float32
        self.panels_ptr = self.panels.data_ptr()

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedPanels:
        n, k = weight.shape
        padded = torch.zeros(-(-n // PANEL) * PANEL, k)
        padded[:n] = weight.detach()
        panels = padded.view(-1, PANEL, k).transpose(1, 2).contiguous()
        return cls(panels, n, k)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def unpack(self) -> torch.Tensor:
        """The float32 weight [N, K] this holds."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]


def fixed_linear(x: torch.Tensor, w: PackedPanels) -> torch.Tensor:
    """x [M, K] float32 -> x @ w.T [M, N] float32, each output summed over k in order."""
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    _library().fixed_linear(
        x.data_ptr(), w.panels_ptr, out.data_ptr(), m, w.out_features, w.in_features
    )
    return out
