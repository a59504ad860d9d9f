/*
 * NEON attention primitives for the shared one-pass driver (attention_impl.h); the layout
 * of the work follows x86/attention_avx2.h: exact int32 block dots reduced four at a time,
 * four key rows summed horizontally together, V accumulated for two heads per pass with
 * 32 columns of accumulators per head in registers.
 */
#include "../internal.h"

#if defined(KERNELS_NEON)
#include <math.h>
#include <string.h>
#include "neon_common.h"

static void attn_quantize_q(const float *q, int64_t rows, int64_t hd, int8_t *qq, float *qd)
{
    quantize_rows_q8_simd(q, rows, hd, qq, qd);   /* sdot is signed x signed: no |q| needed */
}

ALWAYS_INLINE float32x4_t block_scales(const float *c, int64_t b0, int64_t nb)
{
    if (b0 + 4 <= nb)
        return vld1q_f32(c + b0);
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = b0; b < nb; b++)
        t[b - b0] = c[b];
    return vld1q_f32(t);
}

/* q8: s = (sum_b dot_b * qd_b) * (ks[j] * scale);  q4: s = (sum_b dot_b * (qd_b * ks[j, b])) * scale */
ALWAYS_INLINE void scores_int8(const int per_block_ks, const int8_t *qq, const float *qd,
                               int64_t group, int64_t hd, const int8_t *k, const float *ks,
                               int64_t n, float scale, float *s, int64_t ld)
{
    const int64_t nb = hd / QK;
    for (int64_t g = 0; g < group; g++) {
        const int8_t *qg = qq + g * hd;
        const float *qdg = qd + g * nb;
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            const int cnt = n - j0 < 4 ? (int)(n - j0) : 4;
            float32x4_t v[4];
            for (int jj = 0; jj < 4; jj++) {
                v[jj] = vdupq_n_f32(0.0f);
                if (jj >= cnt)
                    continue;
                const int8_t *kr = k + (j0 + jj) * hd;
                for (int64_t b0 = 0; b0 < nb; b0 += 4) {
                    int32x4_t d[4];
                    for (int u = 0; u < 4; u++)
                        d[u] = b0 + u < nb ? dot_block(qg + (b0 + u) * QK, kr + (b0 + u) * QK)
                                           : vdupq_n_s32(0);
                    float32x4_t c = block_scales(qdg, b0, nb);
                    if (per_block_ks)
                        c = vmulq_f32(c, block_scales(ks + (j0 + jj) * nb, b0, nb));
                    v[jj] = vfmaq_f32(v[jj], vcvtq_f32_s32(reduce4_block_s32(d[0], d[1], d[2], d[3])), c);
                }
            }
            float32x4_t sums = hsum4x4_f32(v[0], v[1], v[2], v[3]);
            float tmp[4];
            if (per_block_ks) {
                sums = vmulq_n_f32(sums, scale);
            } else {
                for (int jj = 0; jj < 4; jj++)
                    tmp[jj] = jj < cnt ? ks[j0 + jj] : 0.0f;
                sums = vmulq_f32(sums, vmulq_n_f32(vld1q_f32(tmp), scale));
            }
            if (cnt == 4) {
                vst1q_f32(s + g * ld + j0, sums);
            } else {
                vst1q_f32(tmp, sums);
                for (int jj = 0; jj < cnt; jj++)
                    s[g * ld + j0 + jj] = tmp[jj];
            }
        }
    }
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
    for (int64_t b = 0; b < nblocks; b++) {
        int8x16_t lo, hi;
        unpack_q4_block(k + b * (QK / 2), &lo, &hi);
        vst1q_s8(work + b * QK, lo);
        vst1q_s8(work + b * QK + 16, hi);
    }
    scores_int8(1, qq, qd, group, hd, work, ks, n, scale, s, ld);
}

/* Scores of `group` query rows against n float key rows k float[n, hd]: s = (q . k) * scale.
 * Tiles of two query rows x four key rows share their loads (twelve loads for sixteen
 * multiply-adds; row by row it was two for one, and the loads bound the loop). Each pair keeps
 * the arithmetic it had row by row, two chains of four-lane multiply-adds (columns 0-3 and 4-7 of
 * every 8) added, then hsum4x4_f32: a score has the same bits in any tile, and as before (a
 * q8-weight model's next activations round the same way). Rows and keys past the ends repeat the
 * last one, computed and not stored. */
static void attn_scores_f32(const float *q, int64_t group, int64_t hd, const float *k, int64_t n,
                            float scale, float *s, int64_t ld)
{
    for (int64_t g0 = 0; g0 < group; g0 += 2) {
        const float *q0 = q + g0 * hd, *q1 = q + (g0 + 1 < group ? g0 + 1 : g0) * hd;
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            const float *kr[4];
            for (int jj = 0; jj < 4; jj++)
                kr[jj] = k + (j0 + jj < n ? j0 + jj : n - 1) * hd;
            float32x4_t lo[2][4], hi[2][4];
            for (int i = 0; i < 2; i++)
                for (int jj = 0; jj < 4; jj++)
                    lo[i][jj] = hi[i][jj] = vdupq_n_f32(0.0f);
            for (int64_t d = 0; d < hd; d += 8) {   /* hd is a multiple of 32 */
                const float32x4_t x0 = vld1q_f32(q0 + d), x0h = vld1q_f32(q0 + d + 4);
                const float32x4_t x1 = vld1q_f32(q1 + d), x1h = vld1q_f32(q1 + d + 4);
                for (int jj = 0; jj < 4; jj++) {
                    const float32x4_t a = vld1q_f32(kr[jj] + d), b = vld1q_f32(kr[jj] + d + 4);
                    lo[0][jj] = vfmaq_f32(lo[0][jj], x0, a);
                    hi[0][jj] = vfmaq_f32(hi[0][jj], x0h, b);
                    lo[1][jj] = vfmaq_f32(lo[1][jj], x1, a);
                    hi[1][jj] = vfmaq_f32(hi[1][jj], x1h, b);
                }
            }
            for (int i = 0; i < 2 && g0 + i < group; i++) {
                float tmp[4];
                vst1q_f32(tmp, vmulq_n_f32(hsum4x4_f32(vaddq_f32(lo[i][0], hi[i][0]), vaddq_f32(lo[i][1], hi[i][1]),
                                                       vaddq_f32(lo[i][2], hi[i][2]), vaddq_f32(lo[i][3], hi[i][3])),
                                           scale));
                for (int jj = 0; jj < 4 && j0 + jj < n; jj++)
                    s[(g0 + i) * ld + j0 + jj] = tmp[jj];
            }
        }
    }
}

ALWAYS_INLINE void widen_s8x16(int8x16_t v, float32x4_t *f)
{
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

/* Row j, columns d0..d0+31 as eight float vectors. */
ALWAYS_INLINE void load_row32(const int kind, const void *v, int64_t j, int64_t hd, int64_t d0,
                              float32x4_t f[8])
{
    if (kind == KV_Q8) {
        const int8_t *r = (const int8_t *)v + j * hd + d0;
        widen_s8x16(vld1q_s8(r), f);
        widen_s8x16(vld1q_s8(r + 16), f + 4);
    } else if (kind == KV_Q4) {
        int8x16_t lo, hi;
        unpack_q4_block((const uint8_t *)v + j * (hd / 2) + d0 / 2, &lo, &hi);
        widen_s8x16(lo, f);
        widen_s8x16(hi, f + 4);
    } else {
        const float *r = (const float *)v + j * hd + d0;
        for (int i = 0; i < 8; i++)
            f[i] = vld1q_f32(r + 4 * i);
    }
}

ALWAYS_INLINE void accum_heads(const int kind, const int gh, const void *v, const float *vs,
                               int64_t n, int64_t hd, const float *w0, const float *w1, float *acc0,
                               float *acc1)
{
    const int64_t nb = hd / QK;
    for (int64_t d0 = 0; d0 < hd; d0 += QK) {
        float32x4_t a[8], b[8];
        for (int i = 0; i < 8; i++) {
            a[i] = vld1q_f32(acc0 + d0 + 4 * i);
            b[i] = gh == 2 ? vld1q_f32(acc1 + d0 + 4 * i) : vdupq_n_f32(0.0f);
        }
        for (int64_t j = 0; j < n; j++) {
            float32x4_t f[8];
            load_row32(kind, v, j, hd, d0, f);
            const float bs = kind == KV_Q4 ? vs[j * nb + d0 / QK] : 1.0f;
            const float p0 = kind == KV_Q4 ? w0[j] * bs : w0[j];
            for (int i = 0; i < 8; i++)
                a[i] = vfmaq_n_f32(a[i], f[i], p0);
            if (gh == 2) {
                const float p1 = kind == KV_Q4 ? w1[j] * bs : w1[j];
                for (int i = 0; i < 8; i++)
                    b[i] = vfmaq_n_f32(b[i], f[i], p1);
            }
        }
        for (int i = 0; i < 8; i++) {
            vst1q_f32(acc0 + d0 + 4 * i, a[i]);
            if (gh == 2)
                vst1q_f32(acc1 + d0 + 4 * i, b[i]);
        }
    }
}

/* Row j, columns d0..d0+15 (d0 a multiple of 16) as four float vectors. */
ALWAYS_INLINE void load_row16(const int kind, const void *v, int64_t j, int64_t hd, int64_t d0,
                              float32x4_t f[4])
{
    if (kind == KV_Q8) {
        widen_s8x16(vld1q_s8((const int8_t *)v + j * hd + d0), f);
    } else if (kind == KV_Q4) {
        /* columns 0..15 of a block are the low nibbles of its 16 bytes, 16..31 the high ones */
        const uint8x16_t raw = vld1q_u8((const uint8_t *)v + j * (hd / 2) + (d0 / QK) * (QK / 2));
        const uint8x16_t nib = d0 % QK ? vshrq_n_u8(raw, 4) : vandq_u8(raw, vdupq_n_u8(0x0f));
        widen_s8x16(vsubq_s8(vreinterpretq_s8_u8(nib), vdupq_n_s8(8)), f);
    } else {
        const float *r = (const float *)v + j * hd + d0;
        for (int i = 0; i < 4; i++)
            f[i] = vld1q_f32(r + 4 * i);
    }
}

/* Four rows at once, 16 columns at a time (16 accumulators): every V row is converted to
 * float once for four query rows (a GQA group of 4, or a prefill tile). */
ALWAYS_INLINE void accum_rows4(const int kind, const void *v, const float *vs, int64_t n, int64_t hd,
                               const float *w, int64_t ld, float *acc)
{
    const int64_t nb = hd / QK;
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        float32x4_t a[4][4];
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++)
                a[r][i] = vld1q_f32(acc + r * hd + d0 + 4 * i);
        for (int64_t j = 0; j < n; j++) {
            float32x4_t f[4];
            load_row16(kind, v, j, hd, d0, f);
            const float bs = kind == KV_Q4 ? vs[j * nb + d0 / QK] : 1.0f;
            for (int r = 0; r < 4; r++) {
                const float pr = kind == KV_Q4 ? w[r * ld + j] * bs : w[r * ld + j];
                for (int i = 0; i < 4; i++)
                    a[r][i] = vfmaq_n_f32(a[r][i], f[i], pr);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++)
                vst1q_f32(acc + r * hd + d0 + 4 * i, a[r][i]);
    }
}

ALWAYS_INLINE void mul_inplace(float *x, const float *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        vst1q_f32(x + j, vmulq_f32(vld1q_f32(x + j), vld1q_f32(y + j)));
    for (; j < n; j++)
        x[j] *= y[j];
}

/*
 * q8 V in integers. On the A76 the float accumulation above is bound by its arithmetic, not by
 * memory: per 32 columns of a key row and a pair of heads it spends 8 conversions, 12 widenings
 * and 16 multiply-adds, 25 cycles by llvm-mca's Neoverse N1 model, so 100 cycles a 128-byte row:
 * about 3 GB/s of V a core at 2.4 GHz, below a core's share of the board's memory bandwidth.
 *
 * So the q8 V pass scales a block's weights (w[r, j] * vs[j]) to integers wq in [-ACCUM_Q,
 * ACCUM_Q] against their largest, sums wq * v exactly in int32, and adds each sum times the
 * block's factor once per block. With dotprod, four key rows at a time are interleaved so that
 * each 32-bit lane holds one column's four values, and sdot multiplies them by the four rows'
 * weights, split as wq = 128 * hi + lo (hi, lo int8, read by element): 6 cycles per 32 columns
 * of a row and head pair by the N1 model (bench/gemm_mca.py: 12 for four rows of 16 columns).
 * The rows past the last four, and every row without dotprod, widen to 16 bits and use smlal (16
 * cycles). Both give the same int32 sums, so the same bits.
 *
 * Rounding a weight moves it by at most 2^-15 of the block's largest, which sums to about 2^-14
 * of max|V| in the output, against 2^-8 of a row's largest value for the q8 cache's own rounding
 * (attention_q8_tolerance in kernels.pyx). Weights that cannot be scaled (NaN, inf, or a largest
 * below ACCUM_MIN_WEIGHT) take the float route above.
 */
#define ATTN_ACCUM_Q8_INT 1
#define ACCUM_Q 16256                /* 127 * 128: splits into 128 * hi + lo, hi in [-127, 127], lo in [-64, 63] */
#define ACCUM_ROWS 256               /* 256 * 16256 * 128 < 2^31: a chunk's int32 sums cannot overflow */
#define ACCUM_MIN_WEIGHT 1e-30f      /* ACCUM_Q / it stays finite */

/* The integer weights of n <= ACCUM_ROWS key rows for one query row: wq[j] = round(w[j] * ACCUM_Q
 * / max |w|), and their halves hi = (wq + 64) >> 7, lo = wq - 128 * hi, as sdot reads them: for
 * each four rows j .. j+3, their four hi bytes then their four lo bytes (hl[2 * j] on).
 * Returns the factor back (max |w| / ACCUM_Q), 0 when every weight is 0 (nothing to add), or -1
 * when they cannot be scaled. (The engine's weights are never negative; a caller's own V scales
 * may be.) */
struct accum_weights {
    int16_t wq[ACCUM_ROWS];
    int8_t hl[2 * ACCUM_ROWS];
};

ALWAYS_INLINE float quantize_weights(const float *w, int64_t n, struct accum_weights *q)
{
    float32x4_t m4 = vdupq_n_f32(0.0f);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        m4 = vmaxq_f32(m4, vabsq_f32(vld1q_f32(w + j)));   /* FMAX keeps a NaN (FMAXNM would drop it) */
    float m = vmaxvq_f32(m4);
    for (; j < n; j++)
        m = fabsf(w[j]) > m || w[j] != w[j] ? fabsf(w[j]) : m;
    if (m == 0.0f)
        return 0.0f;
    if (!(m >= ACCUM_MIN_WEIGHT && m <= 3.0e38f))
        return -1.0f;
    const float inv = (float)ACCUM_Q / m;
    for (j = 0; j + 8 <= n; j += 8) {
        const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(w + j), inv));
        const int32x4_t b = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(w + j + 4), inv));
        const int16x8_t wq = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
        const int16x8_t hi = vshrq_n_s16(vaddq_s16(wq, vdupq_n_s16(64)), 7);
        const int32x2_t h = vreinterpret_s32_s8(vmovn_s16(hi));
        const int32x2_t l = vreinterpret_s32_s8(vmovn_s16(vsubq_s16(wq, vshlq_n_s16(hi, 7))));
        vst1q_s16(q->wq + j, wq);
        vst1q_s8(q->hl + 2 * j, vreinterpretq_s8_s32(vcombine_s32(vzip1_s32(h, l), vzip2_s32(h, l))));
    }
    for (; j < n; j++) {
        const int32_t wq = vcvtns_s32_f32(w[j] * inv);
        const int32_t hi = (wq + 64) >> 7;   /* arithmetic shift: floor */
        q->wq[j] = (int16_t)wq;
        q->hl[2 * (j & ~3) + (j & 3)] = (int8_t)hi;
        q->hl[2 * (j & ~3) + 4 + (j & 3)] = (int8_t)(wq - 128 * hi);
    }
    return m / (float)ACCUM_Q;
}

/* acc[r][d] += f[r] * sum_j wq[r][j] * v[j][d] for gh = 1 or 2 query rows, 16 columns at a time. */
ALWAYS_INLINE void accum_int_heads(const int gh, const int8_t *v, int64_t n, int64_t hd,
                                   const struct accum_weights *q0, const struct accum_weights *q1, float f0,
                                   float f1, float *acc0, float *acc1)
{
#if defined(__ARM_FEATURE_DOTPROD)
    const int64_t n4 = n & ~(int64_t)3;
#else
    const int64_t n4 = 0;
#endif
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        int32x4_t a[4], b[4];
        for (int i = 0; i < 4; i++)
            a[i] = b[i] = vdupq_n_s32(0);
#if defined(__ARM_FEATURE_DOTPROD)
        if (n4 > 0) {
            int32x4_t ah[4], al[4], bh[4], bl[4];
            for (int i = 0; i < 4; i++)
                ah[i] = al[i] = bh[i] = bl[i] = vdupq_n_s32(0);
            for (int64_t j = 0; j < n4; j += 4) {
                const int8_t *r = v + j * hd + d0;
                const int8x16_t r0 = vld1q_s8(r), r1 = vld1q_s8(r + hd), r2 = vld1q_s8(r + 2 * hd),
                                r3 = vld1q_s8(r + 3 * hd);
                const int16x8_t z01l = vreinterpretq_s16_s8(vzip1q_s8(r0, r1)), z01h = vreinterpretq_s16_s8(vzip2q_s8(r0, r1));
                const int16x8_t z23l = vreinterpretq_s16_s8(vzip1q_s8(r2, r3)), z23h = vreinterpretq_s16_s8(vzip2q_s8(r2, r3));
                /* c[i]: columns 4i .. 4i+3, each lane the four rows' values of one column */
                const int8x16_t c[4] = {vreinterpretq_s8_s16(vzip1q_s16(z01l, z23l)),
                                        vreinterpretq_s8_s16(vzip2q_s16(z01l, z23l)),
                                        vreinterpretq_s8_s16(vzip1q_s16(z01h, z23h)),
                                        vreinterpretq_s8_s16(vzip2q_s16(z01h, z23h))};
                /* lane 0: the four rows' hi bytes, lane 1 their lo bytes (by-element sdot) */
                const int8x8_t w0 = vld1_s8(q0->hl + 2 * j);
                for (int i = 0; i < 4; i++) {
                    ah[i] = vdotq_lane_s32(ah[i], c[i], w0, 0);
                    al[i] = vdotq_lane_s32(al[i], c[i], w0, 1);
                }
                if (gh == 2) {
                    const int8x8_t w1 = vld1_s8(q1->hl + 2 * j);
                    for (int i = 0; i < 4; i++) {
                        bh[i] = vdotq_lane_s32(bh[i], c[i], w1, 0);
                        bl[i] = vdotq_lane_s32(bl[i], c[i], w1, 1);
                    }
                }
            }
            for (int i = 0; i < 4; i++) {
                a[i] = vaddq_s32(vshlq_n_s32(ah[i], 7), al[i]);
                b[i] = vaddq_s32(vshlq_n_s32(bh[i], 7), bl[i]);
            }
        }
#endif
        for (int64_t j = n4; j < n; j++) {
            const int8x16_t x = vld1q_s8(v + j * hd + d0);
            const int16x8_t lo = vmovl_s8(vget_low_s8(x)), hi = vmovl_high_s8(x);
            const int16_t w0 = q0->wq[j];
            a[0] = vmlal_n_s16(a[0], vget_low_s16(lo), w0);
            a[1] = vmlal_high_n_s16(a[1], lo, w0);
            a[2] = vmlal_n_s16(a[2], vget_low_s16(hi), w0);
            a[3] = vmlal_high_n_s16(a[3], hi, w0);
            if (gh == 2) {
                const int16_t w1 = q1->wq[j];
                b[0] = vmlal_n_s16(b[0], vget_low_s16(lo), w1);
                b[1] = vmlal_high_n_s16(b[1], lo, w1);
                b[2] = vmlal_n_s16(b[2], vget_low_s16(hi), w1);
                b[3] = vmlal_high_n_s16(b[3], hi, w1);
            }
        }
        for (int i = 0; i < 4; i++) {
            float *p0 = acc0 + d0 + 4 * i;
            vst1q_f32(p0, vfmaq_n_f32(vld1q_f32(p0), vcvtq_f32_s32(a[i]), f0));
            if (gh == 2) {
                float *p1 = acc1 + d0 + 4 * i;
                vst1q_f32(p1, vfmaq_n_f32(vld1q_f32(p1), vcvtq_f32_s32(b[i]), f1));
            }
        }
    }
}

/* acc[g, :] += sum_j w[g, j] * v row j (w already times vs) for every row of the group, over
 * chunks of ACCUM_ROWS key rows, two rows at a time where both take the integer route. Each row's
 * bits depend on its own weights only (a query alone gets the bits it gets in a prefill tile): a
 * row whose weights cannot be scaled goes the float way alone, and a row of zero weights adds
 * nothing. */
ALWAYS_INLINE void accum_q8_int(const int8_t *v, int64_t n, int64_t group, int64_t hd, const float *w,
                                int64_t ld, float *acc)
{
    struct accum_weights q[2];
    for (int64_t g = 0; g < group; g += 2) {
        const int gh = group - g >= 2 ? 2 : 1;
        for (int64_t c0 = 0; c0 < n; c0 += ACCUM_ROWS) {
            const int64_t nn = n - c0 < ACCUM_ROWS ? n - c0 : ACCUM_ROWS;
            float f[2] = {0.0f, 0.0f};
            for (int r = 0; r < gh; r++)
                f[r] = quantize_weights(w + (g + r) * ld + c0, nn, &q[r]);
            if (gh == 2 && f[0] > 0.0f && f[1] > 0.0f) {
                accum_int_heads(2, v + c0 * hd, nn, hd, &q[0], &q[1], f[0], f[1], acc + g * hd, acc + (g + 1) * hd);
                continue;
            }
            for (int r = 0; r < gh; r++) {
                float *const ar = acc + (g + r) * hd;
                if (f[r] > 0.0f)
                    accum_int_heads(1, v + c0 * hd, nn, hd, &q[r], NULL, f[r], 0.0f, ar, NULL);
                else if (f[r] < 0.0f)
                    accum_heads(KV_Q8, 1, v + c0 * hd, NULL, nn, hd, w + (g + r) * ld + c0, NULL, ar, NULL);
            }
        }
    }
}

#include "../attention_accum_simd.h"

static float attn_max(const float *s, int64_t n)
{
    float32x4_t m4 = vdupq_n_f32(-INFINITY);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        m4 = vmaxq_f32(m4, vld1q_f32(s + j));
    float m = vmaxvq_f32(m4);
    for (; j < n; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

static float attn_exp_shift(float *s, int64_t n, float m)
{
    const float32x4_t vm = vdupq_n_f32(m);
    float32x4_t sum4 = vdupq_n_f32(0.0f);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float32x4_t e = exp_f32x4(vsubq_f32(vld1q_f32(s + j), vm));
        vst1q_f32(s + j, e);
        sum4 = vaddq_f32(sum4, e);
    }
    float sum = vaddvq_f32(sum4);
    if (j < n) {   /* the tail through the same exp, padded */
        float t[4];
        const int cnt = (int)(n - j);
        for (int i = 0; i < 4; i++)
            t[i] = i < cnt ? s[j + i] : m;
        vst1q_f32(t, exp_f32x4(vsubq_f32(vld1q_f32(t), vm)));
        for (int i = 0; i < cnt; i++) {
            s[j + i] = t[i];
            sum += t[i];
        }
    }
    return sum;
}

static void attn_scale(float *x, int64_t n, float r)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(x + i, vmulq_n_f32(vld1q_f32(x + i), r));
    for (; i < n; i++)
        x[i] *= r;
}

#define ATTN_NAME(x) x##_simd
#include "../attention_impl.h"

#endif /* KERNELS_NEON */
