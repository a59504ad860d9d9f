/*
 * The strips layout's micro-kernel (gemm_strips.h) on plain AVX2, for CPUs without VNNI (Zen 2
 * and 3, Haswell to Skylake): `vpmaddubsw` pairs instead of `vpdpbusd` quads, on the same bytes.
 *
 * AVX2 has 16 registers of 8 lanes, so a tile is half a strip (8 weight rows, lane r = row 8h + r:
 * bytes 32h .. 32h+31 of each of the block's 64-byte vectors) against 3 or 4 activation rows, the
 * strip's other half and further rows re-reading it from L1/L2; one or two rows take the whole
 * strip in one pass (a decode GEMV then reads each line once, at the row route's speed).
 *   q8: the stored u = w ^ 0x80 becomes w again (one XOR a vector, shared by the rows) and |w|
 *       is the unsigned operand, x with w's sign the signed one (the sign trick with the roles
 *       swapped: |w| is computed once per vector, not once per row). |w| <= 128, |x| <= 127, so a
 *       pair sum fits int16 even for w = -128, which the row route's |x| form gets wrong; the dot
 *       is w.x itself and starts at GEMM_FLOAT_MAGIC, not xinit. Four instructions a 32-byte dot,
 *       two of them on the multiply ports: llvm-mca's Zen 3 model runs the loop at 22.9
 *       multiply-adds a cycle against the packed route's 15.0 (bench/gemm_mca.py).
 *   q4: the nibbles are the unsigned operand as stored (0..15); eight groups of pair sums,
 *       8 * 2 * 15 * 128 < 2^15, add up in int16 before one widening `vpmaddwd`; the dot
 *       starts at xinit (the -8 * sum(x) of the nibbles' offset).
 * The float operations are the other routes' (d, then wd * xd, one fused multiply-add per block),
 * so the results are gemm_q8_simd's bits.
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#include "avx2_common.h"
#include "../gemm_pack.h"
#include "../gemm_strips.h"

#define STRIPS_AVX2_MR 4

ALWAYS_INLINE __m256i x_quad(const int8_t *x)
{
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* The block's int32 dots of q8 weights (nh halves of 8 rows) against mr activation rows, from
 * GEMM_FLOAT_MAGIC: acc[h * mr + m]. */
ALWAYS_INLINE void dots_q8(const int nh, const int mr, const uint8_t *blk, const int8_t *const xb[],
                           __m256i acc[])
{
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < nh * mr; i++)
        acc[i] = _mm256_set1_epi32(GEMM_FLOAT_MAGIC);
    /* groups outer, rows inner: the dots in a row of the loop are independent */
#pragma GCC unroll 2
    for (int g = 0; g < QK / 4; g++) {
        __m256i w[2], aw[2];
        for (int h = 0; h < nh; h++) {
            w[h] = _mm256_xor_si256(_mm256_load_si256((const __m256i *)(blk + 64 * g + 32 * h)), flip);
            aw[h] = _mm256_abs_epi8(w[h]);      /* -128 -> 0x80, read as unsigned 128 */
        }
        for (int m = 0; m < mr; m++) {
            const __m256i xq = x_quad(xb[m] + 4 * g);
            for (int h = 0; h < nh; h++)
                acc[h * mr + m] = _mm256_add_epi32(acc[h * mr + m],
                                                   _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xq, w[h])), ones));
        }
    }
}

/* The same for q4 weights, from xinit: pair sums add up in int16 over the block's 8 groups. */
ALWAYS_INLINE void dots_q4(const int nh, const int mr, const uint8_t *blk, const int8_t *const xb[],
                           const int32_t *xinit, int64_t nb, __m256i acc[])
{
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i pairs[2 * STRIPS_AVX2_MR];
    for (int i = 0; i < nh * mr; i++)
        pairs[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int j = 0; j < 4; j++) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < nh; h++) {
            const __m256i v = _mm256_load_si256((const __m256i *)(blk + 64 * j + 32 * h));
            lo[h] = _mm256_and_si256(v, low);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int m = 0; m < mr; m++) {
            const __m256i xl = x_quad(xb[m] + 4 * j), xh = x_quad(xb[m] + 4 * j + 16);
            for (int h = 0; h < nh; h++)
                pairs[h * mr + m] = _mm256_add_epi16(pairs[h * mr + m], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                                         _mm256_maddubs_epi16(hi[h], xh)));
        }
    }
    for (int h = 0; h < nh; h++)
        for (int m = 0; m < mr; m++)
            acc[h * mr + m] = _mm256_add_epi32(_mm256_madd_epi16(pairs[h * mr + m], ones),
                                               _mm256_set1_epi32(xinit[m * nb]));
}

/* Halves h0 .. h0+nh-1 of strip s against activation rows t0 .. t0+mr-1: nh = 2 (the whole strip
 * in one pass) for one or two rows, nh = 1 and up to four rows otherwise, as the 16 registers
 * allow. Constant (is_q4, nh, mr): unrolled. */
ALWAYS_INLINE void strip_tile(const int is_q4, const int nh, const int mr, const struct gemm_strips_args *a,
                              int64_t s, int h0, int64_t t0)
{
    const int64_t nb = a->nb, block_bytes = STRIP_BLOCK_BYTES(is_q4);
    const uint8_t *strip = a->ws + s * a->strip_bytes;
    const uint16_t *scales = (const uint16_t *)(strip + nb * block_bytes) + 8 * h0;
    const __m256 fm = _mm256_set1_ps(GEMM_FLOAT_MAGIC_F);
    const int prefetch = t0 == 0 && h0 == 0;
    const int8_t *xb[STRIPS_AVX2_MR];
    const float *xd[STRIPS_AVX2_MR];
    __m256 f[2 * STRIPS_AVX2_MR];
    for (int m = 0; m < mr; m++) {
        xb[m] = a->x + (t0 + m) * a->K;
        xd[m] = a->xd + (t0 + m) * nb;
    }
    for (int i = 0; i < nh * mr; i++)
        f[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = strip + b * block_bytes;
        if (prefetch)      /* the first pass streams the strip (gemm_strips.h); a hint does not fault */
            for (int l = 0; l < block_bytes; l += 64)
                _mm_prefetch((const char *)(blk + STRIPS_PREFETCH_BYTES + l), _MM_HINT_T1);
        __m256i acc[2 * STRIPS_AVX2_MR];
        if (is_q4)
            dots_q4(nh, mr, blk + 32 * h0, xb, a->xinit + t0 * nb + b, nb, acc);
        else
            dots_q8(nh, mr, blk + 32 * h0, xb, acc);
        for (int h = 0; h < nh; h++) {
            const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * STRIP_ROWS + 8 * h)));
            for (int m = 0; m < mr; m++) {
                const __m256 d = _mm256_sub_ps(_mm256_castsi256_ps(acc[h * mr + m]), fm);
                f[h * mr + m] = _mm256_fmadd_ps(d, _mm256_mul_ps(wd, _mm256_broadcast_ss(xd[m] + b)), f[h * mr + m]);
            }
        }
        for (int m = 0; m < mr; m++)
            xb[m] += QK;
    }
    for (int h = 0; h < nh; h++) {
        const int64_t n0 = s * STRIP_ROWS + 8 * (h0 + h), left = a->N - n0;
        if (left >= 8) {
            for (int m = 0; m < mr; m++)
                _mm256_storeu_ps(a->y + (t0 + m) * a->ldy + n0, f[h * mr + m]);
        } else if (left > 0) {
            const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int m = 0; m < mr; m++)
                _mm256_maskstore_ps(a->y + (t0 + m) * a->ldy + n0, keep, f[h * mr + m]);
        }
    }
}

ALWAYS_INLINE void strips_tiles(const struct gemm_strips_args *a, const int is_q4, const int mr, int64_t t0)
{
    for (int64_t s = a->s0; s < a->s1; s++) {
        if (mr <= 2) {
            strip_tile(is_q4, 2, mr, a, s, 0, t0);
        } else {
            strip_tile(is_q4, 1, mr, a, s, 0, t0);
            strip_tile(is_q4, 1, mr, a, s, 1, t0);
        }
    }
}

void gemm_strips_run_avx2(const struct gemm_strips_args *a)
{
    for (int64_t t0 = 0; t0 < a->mr; t0 += STRIPS_AVX2_MR) {
        const int mr = a->mr - t0 < STRIPS_AVX2_MR ? (int)(a->mr - t0) : STRIPS_AVX2_MR;
        switch (mr) {
        STRIPS_TILES_CASE(strips_tiles, a, 1, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 2, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 3, t0)
        default: STRIPS_TILES_CASE(strips_tiles, a, 4, t0)
        }
    }
}
#endif
