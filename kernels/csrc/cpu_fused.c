/* kernels/cpu_fused.py's kernel (its docstring says how and why). */
#include <math.h>
#include <stdint.h>

/* Each op by rows, callable from any parallel region (`cpu_layer` calls them inside its own),
   and without fused multiply-adds wherever the library that holds them is built: each product
   rounds on its own, as torch's separate ops do. */
#define ROW_MATH __attribute__((optimize("fp-contract=off"))) static void

/* out = rmsnorm(x) * w over one row of H, or with residual: residual += x,
   out = rmsnorm(residual) * w. */
ROW_MATH norm_row(const float *in, float *residual, const float *w, float *out, int64_t H,
                  float eps) {
    float *row = residual ? residual : (float *)in;
    if (residual)
        for (int64_t h = 0; h < H; h++) row[h] += in[h];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
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

/* out[t] = rmsnorm(x[t]) * w, or with residual: residual[t] += x[t];
   out[t] = rmsnorm(residual[t]) * w. */
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
