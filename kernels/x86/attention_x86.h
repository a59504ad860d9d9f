/*
 * The x86 attention primitives of the shared one-pass driver (attention_impl.h), instantiated
 * twice: x86/avx2_attention.c (AVX2) and x86/avx512_attention.c (AVX-512 with VNNI, 32 registers).
 * The two differ only in the int8 scores and the V accumulation (x86/attention_avx2.h,
 * x86/attention_avx512.h) and give the same bits: every score and every accumulator lane goes
 * through the same float operations in the same order, only fewer instructions do it.
 * The including file defines ATTN_NAME, and ATTN_X86_AVX512 for the AVX-512 instantiation.
 */
#ifndef APPLIANCE_ATTENTION_X86_H
#define APPLIANCE_ATTENTION_X86_H
#include <math.h>
#include "avx2_common.h"

/* Eight rows' scores (sums: the rows' block sums, hsum8_ps of their lane vectors) into s[j0..],
 * times the row scales ks[j] (one per row: q8) and `scale`; rows past cnt are not stored. */
ALWAYS_INLINE void scores8_store(const int per_block_ks, __m256 sums, const float *ks, int64_t j0, int cnt,
                                 __m256 vscale, float *s)
{
    float tmp[8];
    if (per_block_ks) {
        sums = _mm256_mul_ps(sums, vscale);
    } else if (cnt == 8) {
        sums = _mm256_mul_ps(sums, _mm256_mul_ps(_mm256_loadu_ps(ks + j0), vscale));
    } else {
        for (int jj = 0; jj < 8; jj++)
            tmp[jj] = jj < cnt ? ks[j0 + jj] : 0.0f;
        sums = _mm256_mul_ps(sums, _mm256_mul_ps(_mm256_loadu_ps(tmp), vscale));
    }
    if (cnt == 8) {
        _mm256_storeu_ps(s + j0, sums);
    } else {
        _mm256_storeu_ps(tmp, sums);
        for (int jj = 0; jj < cnt; jj++)
            s[j0 + jj] = tmp[jj];
    }
}

#if defined(ATTN_X86_AVX512)
#include "attention_avx512.h"
#else
#include "attention_avx2.h"
#endif

/* head_dim 128 (every Qwen3) and 64 get their block count as a constant: fully unrolled. */
ALWAYS_INLINE void scores_int8(const int per_block_ks, const int8_t *qq, const float *qd,
                               int64_t group, int64_t hd, const int8_t *k, const float *ks,
                               int64_t n, float scale, float *s, int64_t ld)
{
    if (hd == 128)
        scores_int8_nb(per_block_ks, 4, qq, qd, group, hd, k, ks, n, scale, s, ld);
    else if (hd == 64)
        scores_int8_nb(per_block_ks, 2, qq, qd, group, hd, k, ks, n, scale, s, ld);
    else
        scores_int8_nb(per_block_ks, hd / QK, qq, qd, group, hd, k, ks, n, scale, s, ld);
}

static void attn_scores_q8(const int8_t *qq, const float *qd, int64_t group, int64_t hd,
                           const int8_t *k, const float *ks, int64_t n, float scale,
                           float *s, int64_t ld)
{
    scores_int8(0, qq, qd, group, hd, k, ks, n, scale, s, ld);
}

/* Unpack the n rows once into work int8[n, hd], shared by every head of the group. */
static void attn_scores_q4(const int8_t *qq, const float *qd, int64_t group, int64_t hd,
                           const uint8_t *k, const float *ks, int64_t n, float scale,
                           float *s, int64_t ld, int8_t *work)
{
    const int64_t nblocks = n * (hd / QK);
    for (int64_t b = 0; b < nblocks; b++)
        _mm256_storeu_si256((__m256i *)(work + b * QK), unpack_q4_32(k + b * (QK / 2)));
    scores_int8(1, qq, qd, group, hd, work, ks, n, scale, s, ld);
}

/* Scores of `group` query rows against n float key rows k float[n, hd]: s = (q . k) * scale.
 * Tiles of two query rows x two key rows share their loads (eight loads for eight multiply-adds;
 * row by row it was two for one, and the loads bound the loop), four such pairs of keys filling
 * one hsum8_ps. Each pair keeps the arithmetic it had row by row, two chains of eight-lane
 * multiply-adds (columns 0-7 and 8-15 of every 16) added, then its lanes summed: a score has the
 * same bits in any tile, and as before (a q8-weight model's next activations round the same
 * way). Rows and keys past the ends repeat the last one, computed and not stored. */
static void attn_scores_f32(const float *q, int64_t group, int64_t hd, const float *k, int64_t n,
                            float scale, float *s, int64_t ld)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g0 = 0; g0 < group; g0 += 2) {
        const float *q0 = q + g0 * hd, *q1 = q + (g0 + 1 < group ? g0 + 1 : g0) * hd;
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            __m256 v[8];   /* v[2 * jj + i]: query row g0 + i against key j0 + jj */
            for (int jp = 0; jp < 4; jp += 2) {
                const float *k0 = k + (j0 + jp < n ? j0 + jp : n - 1) * hd;
                const float *k1 = k + (j0 + jp + 1 < n ? j0 + jp + 1 : n - 1) * hd;
                __m256 a00 = _mm256_setzero_ps(), b00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(),
                       b01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(), b10 = _mm256_setzero_ps(),
                       a11 = _mm256_setzero_ps(), b11 = _mm256_setzero_ps();
                for (int64_t d = 0; d < hd; d += 16) {   /* hd is a multiple of 32 */
                    const __m256 x0 = _mm256_loadu_ps(q0 + d), x0h = _mm256_loadu_ps(q0 + d + 8);
                    const __m256 x1 = _mm256_loadu_ps(q1 + d), x1h = _mm256_loadu_ps(q1 + d + 8);
                    const __m256 c0 = _mm256_loadu_ps(k0 + d), c0h = _mm256_loadu_ps(k0 + d + 8);
                    const __m256 c1 = _mm256_loadu_ps(k1 + d), c1h = _mm256_loadu_ps(k1 + d + 8);
                    a00 = _mm256_fmadd_ps(x0, c0, a00);
                    b00 = _mm256_fmadd_ps(x0h, c0h, b00);
                    a01 = _mm256_fmadd_ps(x0, c1, a01);
                    b01 = _mm256_fmadd_ps(x0h, c1h, b01);
                    a10 = _mm256_fmadd_ps(x1, c0, a10);
                    b10 = _mm256_fmadd_ps(x1h, c0h, b10);
                    a11 = _mm256_fmadd_ps(x1, c1, a11);
                    b11 = _mm256_fmadd_ps(x1h, c1h, b11);
                }
                v[2 * jp] = _mm256_add_ps(a00, b00);
                v[2 * jp + 1] = _mm256_add_ps(a10, b10);
                v[2 * jp + 2] = _mm256_add_ps(a01, b01);
                v[2 * jp + 3] = _mm256_add_ps(a11, b11);
            }
            float t[8];
            _mm256_storeu_ps(t, _mm256_mul_ps(hsum8_ps(v), vscale));
            for (int jj = 0; jj < 4 && j0 + jj < n; jj++)
                for (int i = 0; i < 2 && g0 + i < group; i++)
                    s[(g0 + i) * ld + j0 + jj] = t[2 * jj + i];
        }
    }
}

ALWAYS_INLINE void mul_inplace(float *x, const float *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    for (; j < n; j++)
        x[j] *= y[j];
}

#include "../attention_accum_simd.h"

static float attn_max(const float *s, int64_t n)
{
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    float m = hmax_ps(m8);
    for (; j < n; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

static float attn_exp_shift(float *s, int64_t n, float m)
{
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum_ps(sum8);
    if (j < n) {   /* the tail through the same exp, padded */
        float t[8];
        const int cnt = (int)(n - j);
        for (int i = 0; i < 8; i++)
            t[i] = i < cnt ? s[j + i] : m;
        _mm256_storeu_ps(t, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(t), vm)));
        for (int i = 0; i < cnt; i++) {
            s[j + i] = t[i];
            sum += t[i];
        }
    }
    return sum;
}

static void attn_scale(float *x, int64_t n, float r)
{
    const __m256 vr = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vr));
    for (; i < n; i++)
        x[i] *= r;
}

#include "../attention_impl.h"

#endif /* APPLIANCE_ATTENTION_X86_H */
