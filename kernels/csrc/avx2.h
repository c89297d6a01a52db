/* Helpers every AVX2 kernel source starts with. */
#ifndef RADIXRT_AVX2_H
#define RADIXRT_AVX2_H
#include <immintrin.h>
#include <stdint.h>

/* The sum of a vector's eight lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif /* RADIXRT_AVX2_H */
