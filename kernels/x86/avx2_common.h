/* AVX2 + FMA + F16C building blocks shared by x86/avx2.c and the x86 attention (x86/attention_x86.h). */
#ifndef APPLIANCE_AVX2_COMMON_H
#define APPLIANCE_AVX2_COMMON_H
#include <immintrin.h>
#include "../internal.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE float hmax_ps(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* int8 x int8 -> int32[8] partial sums of 32 products (lane i: 4 neighbouring products).
 * maddubs wants one unsigned operand: move the sign of `s` onto `x` and use |s| (llama.cpp's
 * sign trick). |s| is passed in precomputed because callers reuse it across many dots.
 * Requires values in [-127, 127]: then 2*127*127 fits the int16 pair sums of maddubs. */
ALWAYS_INLINE __m256i dot_i8_abs(__m256i abs_s, __m256i s, __m256i x)
{
    const __m256i sx = _mm256_sign_epi8(x, s);
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), abs_s, sx);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), abs_s, sx);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_s, sx), _mm256_set1_epi16(1));
#endif
}

/* Unsigned x signed bytes (no saturation: |u| <= 15 here) -> int32[8] partial sums. */
ALWAYS_INLINE __m256i dot_u8_i8(__m256i u, __m256i s)
{
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Four int32[8] partial-dot vectors -> int32[4] {sum a, sum b, sum c, sum d}: the exact block
 * dots, so one float conversion and one FMA then serve four of them. */
ALWAYS_INLINE __m128i reduce4_block_i32(__m256i a, __m256i b, __m256i c, __m256i d)
{
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* hsum8_ps of eight vectors v from their pairwise hadds p[i] = hadd(v[2i], v[2i + 1]), for callers
 * that add pairs as they come (fewer live vectors): the same bits. */
ALWAYS_INLINE __m256 hsum8_pairs(const __m256 p[4])
{
    const __m256 a = _mm256_hadd_ps(p[0], p[1]), b = _mm256_hadd_ps(p[2], p[3]);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Eight float[8] vectors -> their eight horizontal sums, in order. */
ALWAYS_INLINE __m256 hsum8_ps(const __m256 v[8])
{
    const __m256 p[4] = {_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]), _mm256_hadd_ps(v[4], v[5]),
                         _mm256_hadd_ps(v[6], v[7])};
    return hsum8_pairs(p);
}

/* 16 bytes of Q4_0 nibbles -> 32 uint8 in [0, 15], element order (low nibbles first). */
ALWAYS_INLINE __m256i nibbles_q4_32(const uint8_t *p)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

/* 16 bytes of Q4_0 nibbles -> 32 int8 in [-8, 7], element order (low nibbles first). */
ALWAYS_INLINE __m256i unpack_q4_32(const uint8_t *p)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0f)), _mm256_set1_epi8(8));
}

/* exp(x), Cephes polynomial: within ~2 ulp of expf over [-87.3, 88]; clamped there (above
 * 88 it returns e^88, below -87.3 FLT_MIN), NaN propagates. Callers need no more range:
 * softmax arguments are <= 0 and silu's exp(-g) only matters while it is below 1e38. */
ALWAYS_INLINE __m256 exp_ps(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);     /* operand order: NaN in x wins */
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_cvtps_epi32(fx);
    const __m256 pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(y, pow2n);
}

#endif
