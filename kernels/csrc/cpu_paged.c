/* kernels/cpu_paged.py's kernel (its docstring says how and why). */
#include "avx2.h"
#include <math.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define BLOCK 32

/* e^x for 8 floats (x <= 0 here), within 2 ulp: 2^n * p(r) with r = x - n ln 2, |r| <= ln2/2. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* q . k over D floats, eight lanes at a time. */
static inline float dot(const float *q, const float *k, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    float total = hsum8(acc);
    for (; d < D; d++) total += q[d] * k[d];
    return total;
}

/* The state of one task's online softmax, per query head g of a KV head: the running max m,
   the sum l, the unnormalized accumulator acc, and the scaled query qs. */
static inline void heads_start(const float *qh, int64_t G, int64_t D, float scale, float *m,
                               float *l, float acc[][MAX_DIM], float qs[][MAX_DIM]) {
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            acc[g][d] = 0.0f;
            qs[g][d] = qh[g * D + d] * scale;
        }
    }
}

/* One block of n scores sc [G][BLOCK] into the softmax state: soft-capped when cap > 0, then
   the block's probabilities into s and the accumulators rescaled to the new maxima. */
static inline void softmax_block(float sc[][BLOCK], float s[][BLOCK], int64_t n, int64_t G,
                                 int64_t D, float cap, float *m, float *l, float acc[][MAX_DIM]) {
    if (cap > 0.0f)
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < n; j++) sc[g][j] = cap * tanhf(sc[g][j] / cap);
    for (int64_t g = 0; g < G; g++) {
        float *sg = sc[g];
        for (int64_t j = n; j < BLOCK; j++) sg[j] = 0.0f;
        float block_max = m[g];
        for (int64_t j = 0; j < n; j++) block_max = sg[j] > block_max ? sg[j] : block_max;
        const float correction = expf(m[g] - block_max);
        __m256 sum8 = _mm256_setzero_ps();
        for (int64_t j = 0; j < BLOCK; j += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(sg + j), _mm256_set1_ps(block_max)));
            const __m256 live = _mm256_cmp_ps(
                _mm256_add_ps(_mm256_set1_ps((float)j), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)),
                _mm256_set1_ps((float)n), _CMP_LT_OQ);
            p = _mm256_and_ps(p, live);
            _mm256_store_ps(s[g] + j, p);
            sum8 = _mm256_add_ps(sum8, p);
        }
        l[g] = l[g] * correction + hsum8(sum8);
        m[g] = block_max;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[g][d] *= correction;
    }
}

/* The state into part [G][D + 2]: the accumulator, then m and l. */
static inline void heads_store(const float *m, const float *l, float acc[][MAX_DIM], int64_t G,
                               int64_t D, float *part) {
    for (int64_t g = 0; g < G; g++) {
        float *o = part + g * (D + 2);
        for (int64_t d = 0; d < D; d++) o[d] = acc[g][d];
        o[D] = m[g];
        o[D + 1] = l[g];
    }
}

/* One task: keys [lo, hi) of request b for KV head h, all G query heads of it. Leaves the
   running max m, the sum l and the unnormalized accumulator in part [G][D + 2]. With cap > 0 each
   score s becomes cap * tanh(s / cap) (Gemma 2's soft-capping). Keys go in blocks
   of BLOCK: each key row is read once for the scores of every query head (vector dot products),
   the accumulators are rescaled once per block, then the values are added, vector FMAs across
   the head dimension. */
static void attend(const float *qh, const float *k, const float *v, const int64_t *rows,
                   int64_t n_keys, int64_t h, int64_t Hkv, int64_t G, int64_t D, float scale,
                   float cap, float *part) {
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM], qs[MAX_GROUP][MAX_DIM];
    float sc[MAX_GROUP][BLOCK] __attribute__((aligned(32))),
        s[MAX_GROUP][BLOCK] __attribute__((aligned(32)));
    heads_start(qh, G, D, scale, m, l, acc, qs);
    for (int64_t start = 0; start < n_keys; start += BLOCK) {
        const int64_t n = n_keys - start < BLOCK ? n_keys - start : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            const float *kr = k + (rows[start + j] * Hkv + h) * D;
            for (int64_t g = 0; g < G; g++) sc[g][j] = dot(qs[g], kr, D);
        }
        softmax_block(sc, s, n, G, D, cap, m, l, acc);
        for (int64_t j = 0; j < n; j++) {
            const float *vr = v + (rows[start + j] * Hkv + h) * D;
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g][j];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[g][d] += p * vr[d];
            }
        }
    }
    heads_store(m, l, acc, G, D, part);
}

/* Inside a parallel region: each (request, query head) merges its key ranges' parts by their
   maxima into out [B, Hq, D] and lse [B, Hq]. */
static void merge_ranges(const float *part, float *out, float *lse, int64_t B, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t splits) {
    const int64_t G = Hq / Hkv, stride = G * (D + 2);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t g = 0; g < G; g++) {
                const float *first = part + (b * Hkv + h) * splits * stride + g * (D + 2);
                float top = -INFINITY, total = 0.0f;
                for (int64_t sp = 0; sp < splits; sp++)
                    top = first[sp * stride + D] > top ? first[sp * stride + D] : top;
                float *o = out + (b * Hq + h * G + g) * D;
                for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                for (int64_t sp = 0; sp < splits; sp++) {
                    const float *pt = first + sp * stride;
                    if (pt[D + 1] == 0.0f) continue; /* an empty range */
                    const float w = expf(pt[D] - top);
                    total += pt[D + 1] * w;
                    for (int64_t d = 0; d < D; d++) o[d] += pt[d] * w;
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
                lse[b * Hq + h * G + g] = total > 0.0f ? top + logf(total) : -INFINITY;
            }
}

/* Quantized pools (`--kv-cache-dtype`, radixrt/mem_cache/kv_quant.py): each (slot, KV head) row
   is W = D + 4 bytes, D one-byte codes then the row's float32 scale. A key or value row is
   decoded once into floats (codes times scale, eight at a time) and then used as the float kernel
   uses its rows: a quarter of the bytes read from memory. */
#include <string.h>

/* Eight codes -> eight floats, to be multiplied by the row's scale. kind 0: int8. 1: FP8 E4M3
   (no infinities): sign, exponent and mantissa moved into a half's fields give the value times
   2^-8, the subnormals too; row_scale puts the 2^8 back. 2: FP8 E5M2, a half's top byte. */
static inline __m256 codes8(const int8_t *p, int64_t kind) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (kind == 0) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m128i h = _mm_cvtepu8_epi16(b);
    if (kind == 2) return _mm256_cvtph_ps(_mm_slli_epi16(h, 8));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(
        _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7)));
}

static inline float row_scale(const int8_t *row, int64_t D, int64_t kind) {
    float s;
    memcpy(&s, row + D, sizeof s);
    return kind == 1 ? s * 256.0f : s;
}

/* A quantized row's D values (D a multiple of 8) into out. */
static inline void load_row(const int8_t *row, int64_t D, int64_t kind, float *out) {
    const __m256 s = _mm256_set1_ps(row_scale(row, D, kind));
    for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_mul_ps(codes8(row + d, kind), s));
}

/* attend() over quantized rows k, v [S, Hkv, D + 4]: the same blocks, online softmax and
   accumulation, each key and value row decoded once into floats first. */
static void attend_quantized(const float *qh, const int8_t *k, const int8_t *v, const int64_t *rows,
                             int64_t n_keys, int64_t h, int64_t Hkv, int64_t G, int64_t D,
                             float scale, float cap, int64_t kind, float *part) {
    const int64_t W = D + 4;
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM], qs[MAX_GROUP][MAX_DIM];
    float sc[MAX_GROUP][BLOCK] __attribute__((aligned(32))),
        s[MAX_GROUP][BLOCK] __attribute__((aligned(32)));
    float row[MAX_DIM] __attribute__((aligned(32)));
    heads_start(qh, G, D, scale, m, l, acc, qs);
    for (int64_t start = 0; start < n_keys; start += BLOCK) {
        const int64_t n = n_keys - start < BLOCK ? n_keys - start : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            load_row(k + (rows[start + j] * Hkv + h) * W, D, kind, row);
            for (int64_t g = 0; g < G; g++) sc[g][j] = dot(qs[g], row, D);
        }
        softmax_block(sc, s, n, G, D, cap, m, l, acc);
        for (int64_t j = 0; j < n; j++) {
            load_row(v + (rows[start + j] * Hkv + h) * W, D, kind, row);
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g][j];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[g][d] += p * row[d];
            }
        }
    }
    heads_store(m, l, acc, G, D, part);
}

/* q [B, Hq, D]; k, v [S, Hkv, D]; slots [B, L]; lens [B]; out [B, Hq, D]; lse [B, Hq].
   Each request's keys are cut into `splits` ranges, one task per (request, KV head, range), so a
   small batch still fills every core; then each (request, KV head) merges its ranges by their
   maxima. part: scratch [B, Hkv, splits, G, D + 2]. kind: -1 for float32 rows k, v [S, Hkv, D];
   else the codes (0 int8, 1 E4M3, 2 E5M2) of quantized rows [S, Hkv, D + 4]. The body runs
   inside any parallel region (`cpu_layer` calls it inside its own); the entry opens one. */
static void paged_decode_body(const float *q, const void *k, const void *v, const int64_t *slots,
                              const int64_t *lens, float *out, float *lse, int64_t B, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t L, float scale, float cap,
                              int64_t splits, float *part, int64_t kind) {
    const int64_t G = Hq / Hkv, stride = G * (D + 2);
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t sp = 0; sp < splits; sp++) {
                const int64_t size = (lens[b] + splits - 1) / splits;
                const int64_t lo = sp * size < lens[b] ? sp * size : lens[b];
                const int64_t hi = lo + size < lens[b] ? lo + size : lens[b];
                const float *qh = q + (b * Hq + h * G) * D;
                float *task = part + ((b * Hkv + h) * splits + sp) * stride;
                if (kind < 0)
                    attend(qh, (const float *)k, (const float *)v, slots + b * L + lo, hi - lo, h,
                           Hkv, G, D, scale, cap, task);
                else
                    attend_quantized(qh, (const int8_t *)k, (const int8_t *)v, slots + b * L + lo,
                                     hi - lo, h, Hkv, G, D, scale, cap, kind, task);
            }
    merge_ranges(part, out, lse, B, Hq, Hkv, D, splits);
}

void paged_decode(const float *q, const void *k, const void *v, const int64_t *slots,
                  const int64_t *lens, float *out, float *lse, int64_t B, int64_t Hq, int64_t Hkv,
                  int64_t D, int64_t L, float scale, float cap, int64_t splits, float *part,
                  int64_t kind) {
#pragma omp parallel
    paged_decode_body(q, k, v, slots, lens, out, lse, B, Hq, Hkv, D, L, scale, cap, splits, part,
                      kind);
}

/* x [T, H, D] float rows -> int8 rows of buf [S, H, D + 4] at slots[t]: codes round(x / scale)
   with scale = max |x| / 127 (0 for a row of zeros, its codes 0), then the scale's bytes; the
   same arithmetic as KVFormat.quantize, so both write the same bytes. */
void quantize_int8(const float *x, const int64_t *slots, int8_t *buf, int64_t T, int64_t H,
                   int64_t D) {
#pragma omp parallel for collapse(2) schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *r = x + (t * H + h) * D;
            int8_t *o = buf + (slots[t] * H + h) * (D + 4);
            float amax = 0.0f;
            for (int64_t d = 0; d < D; d++) amax = fabsf(r[d]) > amax ? fabsf(r[d]) : amax;
            const float scale = amax / 127.0f, div = scale > 0.0f ? scale : 1.0f;
            for (int64_t d = 0; d < D; d++) {
                const float c = nearbyintf(r[d] / div);
                o[d] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
            }
            memcpy(o + D, &scale, sizeof scale);
        }
}
