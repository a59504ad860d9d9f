/*
 * The packed GEMM route's micro-kernel (256-bit registers), the row route's tile run (512-bit
 * registers, 16-row strips) and the strips layout's micro-kernel (gemm_strips.h) with AVX512-VNNI (EVEX vpdpbusd: Cascade Lake, Ice Lake, Zen 4, which
 * lack AVX-VNNI), the one file built for that ISA. Same code and the same run-time check as
 * x86/avx_vnni.c.
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
#include <immintrin.h>
#include "../gemm_pack.h"
#include "gemm_vnni.h"
#include "../gemm_rows.h"
#include "../gemm_strips.h"
#include "avx2_common.h"

#define PACKED_TILE tile_avx512vnni
#define PACKED_DOT(acc, w, xb, axb) _mm256_dpbusd_epi32(acc, w, xb)
#define PACKED_WANTS_ABS 0
#define PACKED_XINIT 1
#include "gemm_packed_x86.h"

void gemm_packed_tile_avx512vnni(const int8_t *pw, int64_t nb, const int8_t *const x[4],
                                 const int8_t *const ax[4], const float *xdT, const int32_t *xinit, float *out)
{
    tile_avx512vnni(pw, nb, x, ax, xdT, xinit, out);
}

#define ROWS_RUN rows_avx512vnni
#define ROWS_DOT(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define ROWS_DOT512(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define ROWS_MR 8   /* 32 vector registers: a strip serves 8 rows */
#include "gemm_rows_x86.h"

void gemm_rows_run_avx512vnni(const struct gemm_rows_args *a)
{
    rows_avx512vnni(a);
}

/* acc + w . (the 4 bytes at x in every lane), the broadcast folded into the dot's memory operand:
 * the compiler emits a separate vpbroadcastd for _mm512_set1_epi32, one more instruction per dot. */
static inline __attribute__((always_inline)) __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *x)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* One strip (16 weight rows, lane r = row r) against activation rows t0 .. t0+mr-1. A block is 8
 * aligned loads (q4: 4, and a mask and a shift each), one scale load, then per row 8 dots from the
 * lanes' start, each reading its 4 activation bytes as a broadcast operand: nothing is shuffled. Constant (is_q4, mr): unrolled. */
static inline __attribute__((always_inline)) void strip_tile(const int is_q4, const int mr,
                                                             const struct gemm_strips_args *a, int64_t s, int64_t t0)
{
    const int64_t nb = a->nb, K = a->K, block_bytes = STRIP_BLOCK_BYTES(is_q4);
    const uint8_t *strip = a->ws + s * a->strip_bytes;
    const uint16_t *scales = (const uint16_t *)(strip + nb * block_bytes);
    const __m512 fm = _mm512_set1_ps(GEMM_FLOAT_MAGIC_F);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 f[8];
    for (int m = 0; m < 8; m++)
        f[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = strip + b * block_bytes;
        if (t0 == 0)      /* past the array's end it is only a hint: prefetches do not fault */
            for (int l = 0; l < block_bytes; l += 64)
                _mm_prefetch((const char *)(blk + STRIPS_PREFETCH_BYTES + l), _MM_HINT_T1);
        __m512i w[8];
        if (is_q4) {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_load_si512((const void *)(blk + 64 * j));
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int g = 0; g < 8; g++)
                w[g] = _mm512_load_si512((const void *)(blk + 64 * g));
        }
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * STRIP_ROWS)));
        /* groups outer, rows inner: the mr dots in a row of the loop are independent (a row's
         * eight dots in a row form one dependency chain, which halved the rate) */
        __m512i acc[8];
        for (int m = 0; m < mr; m++)
            acc[m] = _mm512_set1_epi32(a->xinit[(t0 + m) * nb + b]);
        for (int g = 0; g < QK / 4; g++)
            for (int m = 0; m < mr; m++)
                acc[m] = dpbusd_broadcast(acc[m], w[g], a->x + (t0 + m) * K + b * QK + g * 4);
        for (int m = 0; m < mr; m++) {
            const __m512 d = _mm512_sub_ps(_mm512_castsi512_ps(acc[m]), fm);
            f[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(wd, _mm512_set1_ps(a->xd[(t0 + m) * nb + b])), f[m]);
        }
    }
    const int64_t n0 = s * STRIP_ROWS;
    const __mmask16 keep = a->N - n0 >= STRIP_ROWS ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
    for (int m = 0; m < mr; m++)
        _mm512_mask_storeu_ps(a->y + (t0 + m) * a->ldy + n0, keep, f[m]);
}

static inline __attribute__((always_inline)) void strips_tiles(const struct gemm_strips_args *a, const int is_q4,
                                                               const int mr, int64_t t0)
{
    for (int64_t s = a->s0; s < a->s1; s++)
        strip_tile(is_q4, mr, a, s, t0);
}

void gemm_strips_run_avx512vnni(const struct gemm_strips_args *a)
{
    for (int64_t t0 = 0; t0 < a->mr; t0 += 8) {
        const int mr = a->mr - t0 < 8 ? (int)(a->mr - t0) : 8;
        switch (mr) {
        STRIPS_TILES_CASE(strips_tiles, a, 1, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 2, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 3, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 4, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 5, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 6, t0)
        STRIPS_TILES_CASE(strips_tiles, a, 7, t0)
        default: STRIPS_TILES_CASE(strips_tiles, a, 8, t0)
        }
    }
}
#endif
