/* kernels/int4_gemm.py's kernel (its docstring says how and why). */
#include "avx2.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 8
#define GROUP 32
#define MR 4                     /* activation rows of the GEMM's register tile */
#define BLOCK_BYTES (256 * 1024) /* int8 activations of a block of rows: kept in L2 */
#define AI __attribute__((always_inline))
/* Pins a running sum: without it the compiler reorders a group's 32 integer sums of a 4-row tile
   into one tree, keeps every product live at once and spills them to the stack. */
#define KEEP(v) __asm__("" : "+x"(v))
/* VNNI (`--cpu-isa avx512-vnni`): a group's products go straight into int32 lanes, four at a
   time (`vpdpbusd`, unsigned weight bytes times signed activations), where AVX2 sums pairs into
   int16 (`vpmaddubsw`) and widens them after. Both sums are exact, so the paths agree bit for
   bit. The 256-bit form keeps the 8-row panels: one layout for both paths. */
#ifdef VNNI
#define DOT_INT32 1
#else
#define DOT_INT32 0
#endif

static inline AI __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* 32 floats -> 32 int8 (round to nearest even, as lrintf), in order; *isum: their sum. */
static inline AI __m256i round_group(const float *x, __m256 inv, int32_t *isum) {
    __m256i i[4];
    for (int c = 0; c < 4; c++)
        i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * c), inv));
    const __m256i pairs =
        _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    *isum = (int32_t)hsum8(_mm256_cvtepi32_ps(pairs));
    const __m256i b =
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* x row [K] -> int8 a [G * 32] (zero past K), each group's scale xs [G] and sum xsum [G]:
   a = round(x * (1 / s)), s = max |x| / 127 (1 for a group of zeros), xsum = s * sum(a): the
   quantized activations' sum, not the exact one, so that an offset's share (m * xsum) and the
   integer part's (d q . a s) see the same activations and their rounding errors cancel as in
   (d q + m) . a s: with the exact sum, the error is that of d q alone, which an offset of -8 d
   (Q4_0) makes about twice w's (llama.cpp's Q8_1 activations keep the same sum). */
void quantize_row(const float *row, int8_t *a, float *xs, float *xsum, int64_t K, int64_t G) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t g = 0;
    for (; (g + 1) * GROUP <= K; g++) {
        const float *x = row + g * GROUP;
        __m256 top = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++)
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * c)));
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float m = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
        const float s = m > 0.0f ? m / 127.0f : 1.0f;
        int32_t isum;
        _mm256_storeu_si256((__m256i *)(a + g * GROUP),
                            round_group(x, _mm256_set1_ps(1.0f / s), &isum));
        xs[g] = s;
        xsum[g] = s * (float)isum;
    }
    for (; g < G; g++) { /* the last group, short of 32 inputs */
        const int64_t k0 = g * GROUP, n = K - k0;
        float top = 0.0f;
        for (int64_t k = 0; k < n; k++) top = fmaxf(top, fabsf(row[k0 + k]));
        const float s = top > 0.0f ? top / 127.0f : 1.0f, inv = 1.0f / s;
        int32_t isum = 0;
        for (int64_t k = 0; k < n; k++) isum += a[k0 + k] = (int8_t)lrintf(row[k0 + k] * inv);
        for (int64_t k = n; k < GROUP; k++) a[k0 + k] = 0;
        xs[g] = s;
        xsum[g] = s * (float)isum;
    }
}

/* 5-bit groups: vector q's high bits (16 or 0) for its low nibbles (`half` 0: inputs 4q..4q+3 of
   each lane's row) or its high ones (`half` 1: inputs 16+4q..), from `qh`, whose lane j is row
   j's 32 high bits (bit k for input k, GGUF's Q5_0 `qh`). Byte b of a lane takes byte
   (2 half + q / 2) of the lane's word, and its bit 4 (q % 2) + b. */
static inline AI __m256i high_bits(__m256i qh, int q, int half) {
    const __m256i lanes = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0,
                                           0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i pick = _mm256_add_epi8(lanes, _mm256_set1_epi8((char)(2 * half + q / 2)));
    const int o = 4 * (q % 2);
    const __m256i bit = _mm256_set1_epi32((int)(0x08040201u << o));
    const __m256i set =
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, pick), bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* 6-bit groups: vector q's values for its low nibbles (`qh` the lo word's vector: inputs 0..15)
   or high ones (the hi word's: 16..31), signed (q - 32): byte b of a lane's word holds the top 2
   bits of inputs b, 4 + b, 8 + b and 12 + b of its half at bits 0-1, 2-3, 4-5 and 6-7, so that
   one shift by 2q brings vector q's to bits 0-1 of every byte. */
static inline AI __m256i six_bits(__m256i nibbles, __m256i qh, int q) {
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(qh, 2 * q), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_slli_epi16(top, 4)),
                           _mm256_set1_epi8(32));
}

/* The sub-scaled widths (`int4_gemm.SUB_SCALED`, GGUF's Q3_K and Q2_K): each half of a group
   (a sub-block of 16) scales its values by a small integer of its own. INT3: 2-bit fields as
   6-bit groups' top bits (`six_bits`' order: a vector for each half) and a vector of high bits
   (`three_bits`), values q - 4 in [-4, 3], signed; INT2: the 2-bit fields alone, 0..3. */
#define INT3 3
#define INT2 2
#define SUB_SCALED(bits) ((bits) == INT3 || (bits) == INT2)
/* A group's scales: d and m (`offs`), or for 6 bits each half's d (first 16 inputs, last 16);
   else d alone. INT3: d, then the halves' int8 scales (a pair of bytes a row); INT2: d, dmin,
   then the halves' Q2_K scale bytes (scale in the low nibble, min in the high). */
#define SCALES_WIDTH(bits, offs) \
    ((bits) == INT2 ? 3 * PANEL : (offs) || (bits) == 6 || (bits) == INT3 ? 2 * PANEL : PANEL)
/* IQ4_NL's groups (`bits` IQ4): nibbles as 4-bit ones', each an index into llama.cpp's 16
   non-uniform int8 levels (kvalues_iq4nl), w = d level; no offset. */
#define IQ4 9
#define STORED_BITS(bits) ((bits) == IQ4 ? 4 : (bits))
/* 6-bit, IQ4, INT3 and 8-bit values are signed: their sign moves onto the activation; no
   offset */
#define SIGNED_VALUES(bits) ((bits) >= 6 || (bits) == INT3)
/* whose halves' sums stay apart for a scale each */
#define HALVES(bits) ((bits) == 6 || SUB_SCALED(bits))

/* The sub-scaled widths' values of vector q: its low nibbles' inputs from the first half's 2-bit
   fields (f0), its high ones' from the second's (f1), both in `six_bits`' order (one shift by 2q
   brings vector q's to bits 0-1 of every byte); INT3 adds the high bit (bit j of byte b of a
   lane's word `h`: input 4j + b's, so a shift by q or 4 + q brings it to bit 0), worth 4, less
   4. */
static inline AI void sub_scaled_values(const uint8_t *wg, int q, const int bits, __m256i *lo,
                                        __m256i *hi) {
    const __m256i three = _mm256_set1_epi8(3);
    *lo =
        _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)wg), 2 * q), three);
    *hi = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(wg + 32)), 2 * q),
                           three);
    if (bits == INT3) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(wg + 64)), one = _mm256_set1_epi8(1);
        const __m256i four = _mm256_set1_epi8(4);
        const __m256i hl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi32(h, q), one), 2);
        const __m256i hh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi32(h, q + 4), one), 2);
        *lo = _mm256_sub_epi8(_mm256_or_si256(*lo, hl), four);
        *hi = _mm256_sub_epi8(_mm256_or_si256(*hi, hh), four);
    }
}

/* The sub-scaled widths' integer sum of a group for MT rows: the halves' sums s and t (each at
   most 16 * 4 * 127 in magnitude: int16) times their rows' integer scales (`pairs`: lane j holds
   row j's two, int16), sc0 s + sc1 t, exact. */
static inline AI __m256i sub_scaled_sum(__m256i s, __m256i t, __m256i pairs) {
    return _mm256_madd_epi16(_mm256_blend_epi16(s, _mm256_slli_epi32(t, 16), 0xAA), pairs);
}

/* INT2's activation halves' sums of a group (16 * 127 at most: int16), as a pair in every lane:
   the bytes biased to unsigned and summed 8 at a time (`vpsadbw`), the bias taken off. */
static inline AI __m256i half_sums(const int8_t *ag) {
    const __m256i sad = _mm256_sad_epu8(
        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)ag), _mm256_set1_epi8((char)0x80)),
        _mm256_setzero_si256());
    const __m128i lo = _mm256_castsi256_si128(sad), hi = _mm256_extracti128_si256(sad, 1);
    const int32_t s0 = _mm_cvtsi128_si32(lo) + _mm_extract_epi32(lo, 2) - 16 * 128;
    const int32_t s1 = _mm_cvtsi128_si32(hi) + _mm_extract_epi32(hi, 2) - 16 * 128;
    return _mm256_set1_epi32((int32_t)(((uint32_t)s0 & 0xFFFF) | ((uint32_t)s1 << 16)));
}

static inline AI __m256i iq4_levels(void) {
    return _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                            113, -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                            89, 113);
}

/* MT activation rows (a [MT, Kp] int8, xs and xsum [MT, G]) against one panel, every group:
   acc[i] lane j = output (i, j). Weights `w`: a group every `bits * 32` bytes, packed nibbles
   (4 vectors, unpacked in registers), for 5 bits followed by a vector of high bits (lane j: row
   j's 32, `high_bits`), or signed bytes (8 vectors). Scales `sc`: a group's 8 float16 d, then
   (`offs`) its 8 offsets m; without them the offsets are the symmetric forms' own, -8 d for 4
   bits and -16 d for 5 (Q4_0's and Q5_0's; exact, power-of-two multiples, so the same bits as
   stored) and 0 for 8 (Q8_0's: no term), and the panel reads 2 bytes a group less. 5-bit
   values (up to 31) could overflow int16 sums of 4-bit ones' length: like 8-bit ones they go
   to int32 at each step. 6-bit groups (Q6_K's) are signed, q - 32, with a d for each half of
   the group (its sub-blocks of 16) and no offset: the nibbles' vectors and two of high bits
   (`six_bits`), then 8-bit's arithmetic, the halves' sums kept apart for their scales. */
static inline AI void panel_rows(const int8_t *a, int64_t Kp, const float *xs, const float *xsum,
                                 int64_t G, const uint8_t *w, const uint16_t *sc, __m256 *acc,
                                 const int MT, const int bits, const int offs) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    const int64_t wstep = STORED_BITS(bits) * 32, scw = SCALES_WIDTH(bits, offs);
    const int SIGNED = SIGNED_VALUES(bits);
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = w + g * wstep;
        _mm_prefetch((const char *)(wg + 8 * wstep), _MM_HINT_T0);
        __m256i s[MR], t[MR]; /* t: VNNI's second chain (its sums' latency is in the chain) */
        for (int i = 0; i < MT; i++) s[i] = t[i] = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            __m256i lo, hi;
            if (SUB_SCALED(bits)) {
                sub_scaled_values(wg, q, bits, &lo, &hi);
            } else if (bits != 8) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * q));
                lo = _mm256_and_si256(v, low);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (bits == 5) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(wg + 128));
                    lo = _mm256_or_si256(lo, high_bits(qh, q, 0));
                    hi = _mm256_or_si256(hi, high_bits(qh, q, 1));
                } else if (bits == 6) {
                    lo = six_bits(lo, _mm256_loadu_si256((const __m256i *)(wg + 128)), q);
                    hi = six_bits(hi, _mm256_loadu_si256((const __m256i *)(wg + 160)), q);
                } else if (bits == IQ4) {
                    lo = _mm256_shuffle_epi8(iq4_levels(), lo);
                    hi = _mm256_shuffle_epi8(iq4_levels(), hi);
                }
            } else {
                lo = _mm256_loadu_si256((const __m256i *)(wg + 32 * q));
                hi = _mm256_loadu_si256((const __m256i *)(wg + 32 * (q + 4)));
            }
            const __m256i lo_abs = SIGNED ? _mm256_sign_epi8(lo, lo) : lo;
            const __m256i hi_abs = SIGNED ? _mm256_sign_epi8(hi, hi) : hi;
            for (int i = 0; i < MT; i++) {
                const int8_t *ai = a + i * Kp + g * GROUP + 4 * q;
                const __m256i al = bcast4(ai), ah = bcast4(ai + 16);
#ifdef VNNI
                if (!SIGNED) {
                    s[i] = _mm256_dpbusd_epi32(s[i], lo, al);
                    t[i] = _mm256_dpbusd_epi32(t[i], hi, ah);
                } else {
                    s[i] = _mm256_dpbusd_epi32(s[i], lo_abs, _mm256_sign_epi8(al, lo));
                    t[i] = _mm256_dpbusd_epi32(t[i], hi_abs, _mm256_sign_epi8(ah, hi));
                }
                KEEP(t[i]);
#else
                if (bits == 4) {
                    s[i] = _mm256_add_epi16(s[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, al),
                                                                   _mm256_maddubs_epi16(hi, ah)));
                } else if (bits == 5) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, al),
                                                       _mm256_maddubs_epi16(hi, ah));
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p, ones));
                } else if (HALVES(bits) && SIGNED) { /* the halves apart: a scale each */
                    const __m256i pl = _mm256_maddubs_epi16(lo_abs, _mm256_sign_epi8(al, lo));
                    const __m256i ph = _mm256_maddubs_epi16(hi_abs, _mm256_sign_epi8(ah, hi));
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(pl, ones));
                    t[i] = _mm256_add_epi32(t[i], _mm256_madd_epi16(ph, ones));
                    KEEP(t[i]);
                } else if (bits == INT2) {
                    s[i] = _mm256_add_epi32(s[i],
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(lo, al), ones));
                    t[i] = _mm256_add_epi32(t[i],
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ah), ones));
                    KEEP(t[i]);
                } else {
                    const __m256i pl = _mm256_maddubs_epi16(lo_abs, _mm256_sign_epi8(al, lo));
                    const __m256i ph = _mm256_maddubs_epi16(hi_abs, _mm256_sign_epi8(ah, hi));
                    s[i] = _mm256_add_epi32(s[i], _mm256_add_epi32(_mm256_madd_epi16(pl, ones),
                                                                   _mm256_madd_epi16(ph, ones)));
                }
#endif
                KEEP(s[i]);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * scw)));
        if (SUB_SCALED(bits)) { /* the halves' integer scales, then d (and INT2's mins, dmin) */
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(sc + g * scw + scw - PANEL));
            const __m256i scales = bits == INT3 ? _mm256_cvtepi8_epi16(bytes)
                                                : _mm256_and_si256(_mm256_cvtepu8_epi16(bytes),
                                                                   _mm256_set1_epi16(0xF));
            const __m256i mins = _mm256_srli_epi16(_mm256_cvtepu8_epi16(bytes), 4);
            const __m256 dmin =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * scw + PANEL)));
            for (int i = 0; i < MT; i++) {
                const __m256 x = _mm256_set1_ps(xs[i * G + g]);
                const __m256i isum = sub_scaled_sum(s[i], t[i], scales);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, x), acc[i]);
                if (bits == INT2) {
                    const __m256i msum = _mm256_madd_epi16(mins, half_sums(a + i * Kp + g * GROUP));
                    acc[i] =
                        _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, x), acc[i]);
                }
            }
            continue;
        }
        if (bits == 6) { /* the second half's d where the offsets would be */
            const __m256 d2 =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * scw + PANEL)));
            for (int i = 0; i < MT; i++) {
                const __m256 x = _mm256_set1_ps(xs[i * G + g]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(d, x), acc[i]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[i]), _mm256_mul_ps(d2, x), acc[i]);
            }
            continue;
        }
        const __m256 m =
            offs ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * scw + PANEL)))
                 : _mm256_mul_ps(d, _mm256_set1_ps(bits == 5 ? -16.0f : -8.0f));
        for (int i = 0; i < MT; i++) {
            const __m256i isum = DOT_INT32   ? _mm256_add_epi32(s[i], t[i])
                                 : bits == 4 ? _mm256_madd_epi16(s[i], ones)
                                             : s[i];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                     _mm256_mul_ps(d, _mm256_set1_ps(xs[i * G + g])), acc[i]);
            if (offs || !SIGNED)
                acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[i * G + g]), acc[i]);
        }
    }
}

/* panel_rows, then its outputs (the panel's first nn of 8) with the bias into out [.., N]. */
static inline AI void panel_out(const int8_t *a, int64_t Kp, const float *xs, const float *xsum,
                                int64_t G, const uint8_t *w, const uint16_t *sc, const float *bias,
                                float *out, int64_t N, int64_t n0, int64_t nn, const int MT,
                                const int bits, const int offs) {
    __m256 acc[MR];
    panel_rows(a, Kp, xs, xsum, G, w, sc, acc, MT, bits, offs);
    for (int i = 0; i < MT; i++) {
        float v[PANEL];
        _mm256_storeu_ps(v, acc[i]);
        for (int64_t j = 0; j < nn; j++) out[i * N + n0 + j] = v[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* Rows [m0, m1) of out against panel p: tiles of MR rows, then the rest. */
static inline AI void block_panel(const int8_t *a, const float *xs, const float *xsum,
                                  const uint8_t *w, const uint16_t *sc, const float *bias,
                                  float *out, int64_t m0, int64_t m1, int64_t N, int64_t Kp,
                                  int64_t G, int64_t p, const int bits, const int offs) {
    const int64_t n0 = p * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
#define TILE(r, n)                                                                              \
    panel_out(a + (r) * Kp, Kp, xs + (r) * G, xsum + (r) * G, G, w, sc, bias, out + (r) * N, N, \
              n0, nn, n, bits, offs)
    int64_t i = m0;
    for (; i + MR <= m1; i += MR) TILE(i, MR);
    switch (m1 - i) {
    case 1: TILE(i, 1); break;
    case 2: TILE(i, 2); break;
    case 3: TILE(i, 3); break;
    }
#undef TILE
}

/* out [M, N] = x @ dequant(w).T + bias, x [M, K] float; w [ceil(N/8), G, group bytes * 8];
   sc float16 [ceil(N/8), G, 16] (8 without the offsets: `offs` 0); a [M, G * 32], xs and xsum
   [M, G]: scratch for the quantized rows. Called by every thread of one parallel region (its
   loops are the region's work-sharing loops): the rows' quantization, then the panels, a block
   of rows at a time. Inlined into each entry point with `bits` and `offs` constants, so that each
   form compiles to its own loops.
   Weights are unpacked in registers, by every tile: unpacking a panel once into a buffer for
   all the tiles was 1.1-1.3x slower on AVX-512 hosts (docs/benchmarks.md). */
static inline AI void linear_body(const float *x, int8_t *a, float *xs, float *xsum,
                                  const uint8_t *w, const uint16_t *sc, const float *bias,
                                  float *out, int64_t M, int64_t N, int64_t K, int64_t G,
                                  const int bits, const int offs) {
    const int64_t panels = (N + PANEL - 1) / PANEL, Kp = G * GROUP;
    const int64_t gbytes = STORED_BITS(bits) * 32, scw = SCALES_WIDTH(bits, offs);
    int64_t rows = BLOCK_BYTES / Kp / MR * MR;
    rows = rows < MR ? MR : rows;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, a + m * Kp, xs + m * G, xsum + m * G, K, G);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t m1 = m0 + rows < M ? m0 + rows : M;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++)
            block_panel(a, xs, xsum, w + p * G * gbytes, sc + p * G * scw, bias, out, m0, m1, N, Kp,
                        G, p, bits, offs);
    }
}

/* 16-bit widths (`Bits.F16`, `Bits.BF16`; kinds 16 and 17): a panel's group holds its 32 inputs
   in 16 pairs (2i, 2i + 1), a pair its 8 rows' two weights each, row after row (32 bytes), as
   the file stores them and with no scales. A vector of 16 (AVX-512: one; AVX2: two of 8) becomes
   float32 as it is read (F16 by `vcvtph2ps`; BF16, float32's top half, by a 16-bit shift: both
   exact) and meets the pair's two activations, broadcast as one 64-bit word, in a fused
   multiply-add: lane 2j sums row j's even inputs, lane 2j + 1 its odd ones, in order, from zero;
   the output is their sum, then its bias. No shuffle anywhere, two chains an output, and its
   bits depend on neither the rows computed beside it, nor the tile, nor the path (AVX2 and
   AVX-512 do the same operations lane by lane). An odd K's last input pairs with a zero. */
#define F16 16
#define BF16 17
#define HALF_MR 6   /* activation rows of a register tile, at most */
#define HALF_QUAD 4 /* panels a thread takes at a time */

/* half_load: vector v of the pair at w, as float32; half_pair: a pair's two activations (one
   64-bit word) in every pair of lanes. */
#ifdef AVX512
/* AVX-512 (`-DAVX512`: the avx512-vnni and amx paths): a panel's pair is one vector */
#define HALF_VECS 1
typedef __m512 hvec;
#define hzero _mm512_setzero_ps
#define hfmadd _mm512_fmadd_ps
#define hstoreu _mm512_storeu_ps
static inline AI hvec half_load(const uint16_t *w, int v, const int kind) {
    (void)v;
    const __m256i h = _mm256_loadu_si256((const __m256i *)w);
    return kind == F16 ? _mm512_cvtph_ps(h)
                       : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline AI hvec half_pair(double pair) {
    return _mm512_castpd_ps(_mm512_set1_pd(pair));
}
#else
/* AVX2: a panel's pair is two vectors, rows 0-3 and rows 4-7 */
#define HALF_VECS 2
typedef __m256 hvec;
#define hzero _mm256_setzero_ps
#define hfmadd _mm256_fmadd_ps
#define hstoreu _mm256_storeu_ps
static inline AI hvec half_load(const uint16_t *w, int v, const int kind) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(w + 8 * v));
    return kind == F16 ? _mm256_cvtph_ps(h)
                       : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline AI hvec half_pair(double pair) {
    return _mm256_castpd_ps(_mm256_set1_pd(pair));
}
#endif

/* Inputs k and k + 1 (`last`: k alone, the last of an odd K, its partner zero) of MT rows of x
   [., K] against NP panels from panel p (w: [panels, Kp / 2, 8, 2] uint16), into acc. */
static inline AI void half_step(hvec acc[HALF_MR][HALF_QUAD][HALF_VECS], const float *x, int64_t K,
                                const uint16_t *w, int64_t Kp, int64_t p, int64_t k, const int MT,
                                const int NP, const int last, const int kind) {
    for (int q = 0; q < NP; q++) {
        const uint16_t *pair = w + (p + q) * Kp * PANEL + k * PANEL;
        hvec wv[HALF_VECS];
        for (int v = 0; v < HALF_VECS; v++) wv[v] = half_load(pair, v, kind);
        for (int i = 0; i < MT; i++) {
            const float two[2] = {x[i * K + k], last ? 0.0f : x[i * K + k + 1]};
            double word;
            memcpy(&word, two, sizeof word);
            const hvec a = half_pair(word);
            for (int v = 0; v < HALF_VECS; v++) acc[i][q][v] = hfmadd(a, wv[v], acc[i][q][v]);
        }
    }
}

/* MT rows of x [., K] against NP panels from panel p (every one exists): out[i, n], the bias
   added, for the n < N they hold. */
static inline AI void half_tile(const float *x, int64_t K, const uint16_t *w, int64_t Kp, int64_t p,
                                const float *bias, float *out, int64_t N, const int MT,
                                const int NP, const int kind) {
    hvec acc[HALF_MR][HALF_QUAD][HALF_VECS];
    for (int i = 0; i < MT; i++)
        for (int q = 0; q < NP; q++)
            for (int v = 0; v < HALF_VECS; v++) acc[i][q][v] = hzero();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) half_step(acc, x, K, w, Kp, p, k, MT, NP, 0, kind);
    if (k < K) half_step(acc, x, K, w, Kp, p, k, MT, NP, 1, kind);
    for (int i = 0; i < MT; i++) {
        for (int q = 0; q < NP; q++) {
            float sums[2 * PANEL];
            for (int v = 0; v < HALF_VECS; v++) hstoreu(sums + v * 16 / HALF_VECS, acc[i][q][v]);
            const int64_t n0 = (p + q) * PANEL;
            for (int64_t j = 0; j < PANEL && n0 + j < N; j++) {
                const float sum = sums[2 * j] + sums[2 * j + 1];
                out[i * N + n0 + j] = bias ? sum + bias[n0 + j] : sum;
            }
        }
    }
}

/* MT rows against the HALF_QUAD panels from panel p that exist, NP at a time: as many as the
   registers hold sums of (AVX2's 16: 4 panels of 1 row, 2 of 2, 1 of 3 to 6; AVX-512's 32: 4 of
   up to 6), so that a decode row keeps several chains in flight (AVX2: 8 vectors). */
static inline AI void half_rows(const float *x, int64_t K, const uint16_t *w, int64_t Kp,
                                int64_t panels, int64_t p, const float *bias, float *out, int64_t N,
                                const int MT, const int kind) {
    const int NP = HALF_VECS == 1 || MT == 1 ? 4 : MT == 2 ? 2 : 1;
    for (int64_t q = p; q < p + HALF_QUAD && q < panels; q += NP) {
        if (q + NP <= panels) {
            half_tile(x, K, w, Kp, q, bias, out, N, MT, NP, kind);
        } else {
            for (int64_t r = q; r < panels; r++)
                half_tile(x, K, w, Kp, r, bias, out, N, MT, 1, kind);
        }
    }
}

/* out [M, N] = x @ w.T + bias, x [M, K] float, w 16-bit [ceil(N/8), Kp / 2, 8, 2] (`kind` F16 or
   BF16). Called by every thread of one parallel region, like linear_body: blocks of rows that
   stay in L2, each walked past every HALF_QUAD panels (shared out over the threads), HALF_MR rows
   at a time; no barrier after. */
static inline AI void half_body(const float *x, const uint16_t *w, const float *bias, float *out,
                                int64_t M, int64_t N, int64_t K, int64_t Kp, const int kind) {
    const int64_t panels = (N + PANEL - 1) / PANEL, quads = (panels + HALF_QUAD - 1) / HALF_QUAD;
    int64_t rows = BLOCK_BYTES / (4 * K) / HALF_MR * HALF_MR;
    rows = rows < HALF_MR ? HALF_MR : rows;
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t m1 = m0 + rows < M ? m0 + rows : M;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < quads; t++) {
#define HALF_ROWS(m, n) \
    half_rows(x + (m) * K, K, w, Kp, panels, t * HALF_QUAD, bias, out + (m) * N, N, n, kind)
            int64_t m = m0;
            for (; m + HALF_MR <= m1; m += HALF_MR) HALF_ROWS(m, HALF_MR);
            switch (m1 - m) {
            case 1: HALF_ROWS(m, 1); break;
            case 2: HALF_ROWS(m, 2); break;
            case 3: HALF_ROWS(m, 3); break;
            case 4: HALF_ROWS(m, 4); break;
            case 5: HALF_ROWS(m, 5); break;
            }
#undef HALF_ROWS
        }
    }
}

#ifdef AMX
/* AMX (`--cpu-isa amx`), for many rows: the same panels and quantized rows, each group's products
   summed by the tile unit, 16 activation rows by 16 weight rows (two panels) a `tdpbsud` (signed
   activations by unsigned 4-bit weights) or `tdpbssd` (signed 8-bit weights). The int32 sums are
   exact, as every path's, and each goes through the same float operations in the same order as
   panel_rows's, so the outputs are the other paths' bits. Tiles: activations 16 rows x 32 bytes
   (a group of each row, read in place from the quantized rows); weights 8 x 64 bytes, the tile
   unit's dot-product layout, which is the panels' own: a panel's vector t holds, in lane j, the
   4-byte word t of row j's group (its nibbles unpacked: inputs 4t..4t+3), so a weight tile's row
   t is vector t of two panels side by side, unpacked once per call; sums 16 x 16 int32 (activation
   row by weight row), four a group (2 x 2 blocks: each activation and weight tile loaded once for
   two). Linux gives a process the tile state only once it has asked (arch_prctl; `cpu_isa` asks
   before offering this path). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(void) {
    TileConfig c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) c.rows[t] = 16, c.colsb[t] = 32; /* activations */
    for (int t = 2; t < 4; t++) c.rows[t] = 8, c.colsb[t] = 64;  /* weights */
    for (int t = 4; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64; /* sums */
    _tile_loadconfig(&c);
}

/* Block `blk` of 16 weight rows (panels 2 blk and 2 blk + 1; a missing second panel is zeros),
   every group: the weight tiles wb [G, 8, 64] and the rows' d and m as floats [G, 16]. */
static inline AI void unpack_block(const uint8_t *w, const uint16_t *sc, int64_t panels, int64_t G,
                                   int64_t blk, uint8_t *wb, float *d, float *m, const int bits,
                                   const int offs) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int64_t gbytes = STORED_BITS(bits) * 32, scw = offs ? 2 * PANEL : PANEL;
    for (int h = 0; h < 2; h++) {
        const int64_t p = 2 * blk + h;
        for (int64_t g = 0; g < G; g++) {
            uint8_t *rows = wb + g * 512 + 32 * h; /* this panel's half of each tile row */
            float *dg = d + g * 16 + h * PANEL, *mg = m + g * 16 + h * PANEL;
            if (p >= panels) {
                for (int t = 0; t < 8; t++)
                    _mm256_store_si256((__m256i *)(rows + 64 * t), _mm256_setzero_si256());
                _mm256_store_ps(dg, _mm256_setzero_ps());
                _mm256_store_ps(mg, _mm256_setzero_ps());
                continue;
            }
            const uint8_t *wg = w + (p * G + g) * gbytes;
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * t));
                if (bits != 8) {
                    __m256i lo = _mm256_and_si256(v, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (bits == 5) {
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(wg + 128));
                        lo = _mm256_or_si256(lo, high_bits(qh, t, 0));
                        hi = _mm256_or_si256(hi, high_bits(qh, t, 1));
                    } else if (bits == IQ4) {
                        lo = _mm256_shuffle_epi8(iq4_levels(), lo);
                        hi = _mm256_shuffle_epi8(iq4_levels(), hi);
                    }
                    _mm256_store_si256((__m256i *)(rows + 64 * t), lo);
                    _mm256_store_si256((__m256i *)(rows + 64 * (t + 4)), hi);
                } else {
                    _mm256_store_si256((__m256i *)(rows + 64 * t), v);
                    _mm256_store_si256((__m256i *)(rows + 64 * (t + 4)),
                                       _mm256_loadu_si256((const __m256i *)(wg + 32 * (t + 4))));
                }
            }
            const uint16_t *s = sc + (p * G + g) * scw;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
            _mm256_store_ps(dg, dv);
            _mm256_store_ps(mg,
                            offs ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + PANEL)))
                                 : _mm256_mul_ps(dv, _mm256_set1_ps(bits == 5 ? -16.0f : -8.0f)));
        }
    }
}

/* One group's sums (16 x 16 int32, activation row by weight row) into those rows'
   accumulators (in memory: four tiles' do not fit in registers): panel_rows's float
   operations, in its order. */
static inline AI void tile_sums(const int32_t (*sums)[16], const float *d, const float *m,
                                const float *xs, const float *xsum, int64_t G, int64_t g,
                                int64_t mb, float (*acc)[16], const int bits, const int offs) {
    const __m512 dv = _mm512_load_ps(d + g * 16), mv = _mm512_load_ps(m + g * 16);
    for (int i = 0; i < 16; i++) {
        const int64_t r = (mb * 16 + i) * G + g;
        const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums[i]));
        __m512 a =
            _mm512_fmadd_ps(s, _mm512_mul_ps(dv, _mm512_set1_ps(xs[r])), _mm512_load_ps(acc[i]));
        if (offs || !SIGNED_VALUES(bits)) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r]), a);
        _mm512_store_ps(acc[i], a);
    }
}

/* A block's outputs (16 activation rows from mb, 16 weight rows from n0) from `acc`, with the
   bias: the rows and columns that exist. */
static inline AI void tile_out(float (*acc)[16], int64_t mb, const float *bias, float *out,
                               int64_t M, int64_t N, int64_t n0) {
    const int64_t rows = M - mb * 16 < 16 ? M - mb * 16 : 16;
    const int64_t cols = N - n0 < 16 ? N - n0 : 16;
    if (cols <= 0) return;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(out + (mb * 16 + i) * N + n0, keep,
                              _mm512_add_ps(_mm512_load_ps(acc[i]), add));
}

/* Two blocks of 16 activation rows (mb, mb + 1; only mb where it is the last) by two blocks of
   16 weight rows (wb[0], wb[1]: 32 rows from n0), every group. A weight block past the weights
   is zeros and activation rows past M are zeros: their outputs are not written. */
static inline AI void tile_block(uint8_t *const *wb, float *const *d, float *const *m,
                                 const int8_t *a, int64_t Kp, const float *xs, const float *xsum,
                                 int64_t Mp, int64_t G, int64_t mb, const float *bias, float *out,
                                 int64_t M, int64_t N, int64_t n0, const int bits, const int offs) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    float acc[4][16][16] __attribute__((aligned(64)));
    const int two = mb + 1 < Mp / 16;
    memset(acc, 0, sizeof acc);
    for (int64_t g = 0; g < G; g++) {
        _tile_loadd(0, a + mb * 16 * Kp + g * GROUP, Kp);
        _tile_loadd(2, wb[0] + g * 512, 64);
        _tile_loadd(3, wb[1] + g * 512, 64);
        _tile_zero(4);
        _tile_zero(5);
        if (two) {
            _tile_loadd(1, a + (mb + 1) * 16 * Kp + g * GROUP, Kp);
            _tile_zero(6);
            _tile_zero(7);
        }
        if (!SIGNED_VALUES(bits)) { /* signed activations by unsigned 4- or 5-bit values */
            _tile_dpbsud(4, 0, 2);
            _tile_dpbsud(5, 0, 3);
            if (two) {
                _tile_dpbsud(6, 1, 2);
                _tile_dpbsud(7, 1, 3);
            }
        } else {
            _tile_dpbssd(4, 0, 2);
            _tile_dpbssd(5, 0, 3);
            if (two) {
                _tile_dpbssd(6, 1, 2);
                _tile_dpbssd(7, 1, 3);
            }
        }
        _tile_stored(4, sums[0], 64);
        _tile_stored(5, sums[1], 64);
        if (two) {
            _tile_stored(6, sums[2], 64);
            _tile_stored(7, sums[3], 64);
        }
        for (int t = 0; t < (two ? 4 : 2); t++)
            tile_sums(sums[t], d[t % 2], m[t % 2], xs, xsum, G, g, mb + t / 2, acc[t], bits, offs);
    }
    for (int t = 0; t < (two ? 4 : 2); t++)
        tile_out(acc[t], mb + t / 2, bias, out, M, N, n0 + 16 * (t % 2));
}

/* out [M, N] = x @ dequant(w).T + bias on the tile unit: linear_body's rows quantized into a,
   xs and xsum, which hold Mp rows (M rounded up to 16; the rows past M are zeros); then each
   thread takes pairs of blocks of 16 weight rows, unpacks a pair once and multiplies it by
   every pair of row blocks (unpacking again for chunks of rows kept in L2 cost more: a quarter
   of the time at 128 rows). */
static inline AI void amx_body(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                               const uint16_t *sc, const float *bias, float *out, int64_t M,
                               int64_t N, int64_t K, int64_t G, const int bits, const int offs) {
    const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (panels + 3) / 4, Kp = G * GROUP;
    const int64_t Mp = (M + 15) / 16 * 16;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < Mp; r++) {
        if (r < M) {
            quantize_row(x + r * K, a + r * Kp, xs + r * G, xsum + r * G, K, G);
        } else {
            memset(a + r * Kp, 0, Kp);
            memset(xs + r * G, 0, G * sizeof(float));
            memset(xsum + r * G, 0, G * sizeof(float));
        }
    }
    uint8_t *wb[2];
    float *d[2], *m[2];
    for (int h = 0; h < 2; h++) {
        wb[h] = aligned_alloc(64, G * 512);
        d[h] = aligned_alloc(64, G * 16 * sizeof(float));
        m[h] = aligned_alloc(64, G * 16 * sizeof(float));
    }
    amx_configure();
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < pairs; pair++) {
        for (int h = 0; h < 2; h++)
            unpack_block(w, sc, panels, G, 2 * pair + h, wb[h], d[h], m[h], bits, offs);
        for (int64_t mb = 0; mb < Mp / 16; mb += 2)
            tile_block(wb, d, m, a, Kp, xs, xsum, Mp, G, mb, bias, out, M, N, 32 * pair, bits,
                       offs);
    }
    _tile_release();
    for (int h = 0; h < 2; h++) free(wb[h]), free(d[h]), free(m[h]);
}

#define AMX_BODY(bits, offs)                                                  \
    ((offs) ? amx_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, bits, 1) \
            : amx_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, bits, 0))

/* int4_linear and q8_linear on the tile unit; a, xs and xsum hold M rounded up to 16 rows. */
void int4_linear_amx(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                     const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N,
                     int64_t K, int64_t G, int64_t offs) {
#pragma omp parallel
    AMX_BODY(4, offs);
}

void iq4_linear_amx(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                    const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N,
                    int64_t K, int64_t G, int64_t offs) {
#pragma omp parallel
    AMX_BODY(IQ4, offs);
}

void int5_linear_amx(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                     const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N,
                     int64_t K, int64_t G, int64_t offs) {
#pragma omp parallel
    AMX_BODY(5, offs);
}

void q8_linear_amx(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                   const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N,
                   int64_t K, int64_t G, int64_t offs) {
#pragma omp parallel
    AMX_BODY(8, offs);
}
#endif

/* linear_body with `bits` and `offs` as constants of the branch taken. */
#define GROUPED_BODY(bits, offs)                                                 \
    ((offs) ? linear_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, bits, 1) \
            : linear_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, bits, 0))

void int4_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t G, int64_t offs) {
#pragma omp parallel
    GROUPED_BODY(4, offs);
}

void int5_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t G, int64_t offs) {
#pragma omp parallel
    GROUPED_BODY(5, offs);
}

void iq4_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                int64_t G, int64_t offs) {
#pragma omp parallel
    GROUPED_BODY(IQ4, offs);
}

/* 6-bit groups have no offsets and no AMX path (their halves' sums need K = 16 tiles): an AMX
   host takes this, its VNNI code. */
void int6_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t G, int64_t offs) {
    (void)offs;
#pragma omp parallel
    linear_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, 6, 0);
}

void q8_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
               const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
               int64_t G, int64_t offs) {
#pragma omp parallel
    GROUPED_BODY(8, offs);
}

/* The sub-scaled widths: their scales' slots are fixed (`offs` unused) and, like 6-bit groups',
   they have no AMX path: an AMX host takes these, their VNNI code. */
void int3_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t G, int64_t offs) {
    (void)offs;
#pragma omp parallel
    linear_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, INT3, 0);
}

void int2_linear(const float *x, int8_t *a, float *xs, float *xsum, const uint8_t *w,
                 const uint16_t *sc, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t G, int64_t offs) {
    (void)offs;
#pragma omp parallel
    linear_body(x, a, xs, xsum, w, sc, bias, out, M, N, K, G, INT2, 0);
}

/* 16-bit widths (`half_body`): `kind` F16 or BF16, Kp the padded inputs of a panel. */
void half_linear(const float *x, const uint16_t *w, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int64_t Kp, int64_t kind) {
#pragma omp parallel
    {
        if (kind == F16)
            half_body(x, w, bias, out, M, N, K, Kp, F16);
        else
            half_body(x, w, bias, out, M, N, K, Kp, BF16);
    }
}
