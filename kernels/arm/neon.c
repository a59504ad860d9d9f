/*
 * AArch64 NEON path (sdot with dotprod; vmull/vpadal without): quantize, Q8_0/Q4_0
 * GEMM/GEMV, rmsnorm, rope, silu_mul. Attention is in neon_attention.c.
 * The tiling and the float arithmetic per output are those of the AVX2 path
 * (x86/avx2.c): exact int32 block dots, one FMA per block with wd * xd.
 */
#include "../internal.h"

#if defined(KERNELS_NEON)
#include <math.h>
#include "neon_common.h"

/* ---- activations ------------------------------------------------------- */

void quantize_rows_q8_simd(const float *x, int64_t M, int64_t K, int8_t *q, float *d)
{
    const int64_t nblocks = M * (K / QK);
    for (int64_t b = 0; b < nblocks; b++) {
        const float *xb = x + b * QK;
        float32x4_t v[8];
        float32x4_t amax4 = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(xb + 4 * i);
            amax4 = vmaxq_f32(amax4, vabsq_f32(v[i]));
        }
        const float amax = vmaxvq_f32(amax4);
        /* Float32 operations of the numpy reference; vcvtnq rounds half to even like np.rint. */
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        int16x8_t h[4];
        for (int i = 0; i < 4; i++) {
            const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(v[2 * i], inv));
            const int32x4_t c = vcvtnq_s32_f32(vmulq_n_f32(v[2 * i + 1], inv));
            h[i] = vcombine_s16(vqmovn_s32(a), vqmovn_s32(c));
        }
        vst1q_s8(q + b * QK, vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])));
        vst1q_s8(q + b * QK + 16, vcombine_s8(vqmovn_s16(h[2]), vqmovn_s16(h[3])));
    }
}

/* ---- KV cache rows ------------------------------------------------------- */

/* quantize_group_q8 of a whole KV row (n a multiple of 32) with the same float32 operations: the
 * same bytes and scale. */
static inline __attribute__((always_inline)) float quantize_kv_row(const float *x, int64_t n, int8_t *q)
{
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < n; i += 4)
        m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + i)));
    const float amax = vmaxvq_f32(m);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < n; i += 16) {
        int16x8_t s[2];
        for (int j = 0; j < 2; j++) {
            const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + i + 8 * j), inv));
            const int32x4_t c = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + i + 8 * j + 4), inv));
            s[j] = vcombine_s16(vqmovn_s32(a), vqmovn_s32(c));
        }
        vst1q_s8(q + i, vcombine_s8(vqmovn_s16(s[0]), vqmovn_s16(s[1])));
    }
    return amax / 127.0f;
}

void kv_store_q8_simd(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                      int8_t *dst, float *scale)
{
    kv_store_q8_rows(x, T, n_kv, hd, slot, bs, dst, scale, quantize_kv_row);
}

/* ---- GEMM ---------------------------------------------------------------- */

#define NR 4   /* weight rows per tile */
#define MR 4   /* activation rows per tile */

ALWAYS_INLINE void gemm_tile(const int is_q4, const int mr, const uint8_t *const wrow[NR],
                             const uint16_t *const wdrow[NR], int64_t nb, const int8_t *x,
                             int64_t K, const float *xd, const int32_t *xsum8, float *y, int64_t ldy,
                             int ncols, int64_t prefetch_ahead)
{
    (void)xsum8;   /* see GEMM_Q4_XSUM8 below */
    float32x4_t acc[MR];   /* acc[m] = y[m, n0..n0+3] */
    for (int m = 0; m < mr; m++)
        acc[m] = vdupq_n_f32(0.0f);

    for (int64_t b = 0; b < nb; b++) {
        int8x16_t wlo[NR], whi[NR];
        for (int r = 0; r < NR; r++) {
            if (prefetch_ahead)
                __builtin_prefetch(wrow[r] + prefetch_ahead + b * (is_q4 ? QK / 2 : QK));
            if (is_q4) {
                unpack_q4_block(wrow[r] + b * (QK / 2), &wlo[r], &whi[r]);
            } else {
                wlo[r] = vld1q_s8((const int8_t *)wrow[r] + b * QK);
                whi[r] = vld1q_s8((const int8_t *)wrow[r] + b * QK + 16);
            }
        }
        const float32x4_t wscale = halves4(wdrow[0][b], wdrow[1][b], wdrow[2][b], wdrow[3][b]);

        for (int m = 0; m < mr; m++) {
            const int8x16_t xlo = vld1q_s8(x + m * K + b * QK);
            const int8x16_t xhi = vld1q_s8(x + m * K + b * QK + 16);
            int32x4_t d[NR];
            for (int r = 0; r < NR; r++)
                d[r] = dot_s8x16(dot_s8x16(vdupq_n_s32(0), wlo[r], xlo), whi[r], xhi);
            const int32x4_t dots = reduce4_block_s32(d[0], d[1], d[2], d[3]);
            const float32x4_t s = vmulq_n_f32(wscale, xd[m * nb + b]);
            acc[m] = vfmaq_f32(acc[m], vcvtq_f32_s32(dots), s);
        }
    }

    for (int m = 0; m < mr; m++) {
        if (ncols == NR) {
            vst1q_f32(y + m * ldy, acc[m]);
        } else {
            float tmp[NR];
            vst1q_f32(tmp, acc[m]);
            for (int c = 0; c < ncols; c++)
                y[m * ldy + c] = tmp[c];
        }
    }
}

#if defined(KERNELS_NEON_DOTPROD)
#include "../gemm_pack.h"

/* The packed route's micro-kernel (gemm_pack.h), sized for the Cortex-A76: 4 activation rows x 8
 * weight rows, 8 int32 accumulators (v0-v7), 8 float accumulators (v8-v15), the rows' 16-byte
 * halves (v16-v19), one group of packed weights (v20-v21). Per 32-block: 64 sdot by element and
 * 24 float operations (8 times: subtract the magic, scale = wd * xd, fused multiply-add) on the two
 * vector pipes, 72.7% of them sdot; the accumulators start from GEMM_FLOAT_MAGIC loaded from memory
 * (the load pipes), so nothing else reaches the vector pipes. In assembly so that what
 * bench/gemm_mca.py analyses is what runs: the compiler spilled the accumulators of the C version.
 * Same float operations as gemm_tile per output and block: the same bits. */
static const int32_t gemm_magic8[8] __attribute__((aligned(32))) = {
    GEMM_FLOAT_MAGIC, GEMM_FLOAT_MAGIC, GEMM_FLOAT_MAGIC, GEMM_FLOAT_MAGIC,
    GEMM_FLOAT_MAGIC, GEMM_FLOAT_MAGIC, GEMM_FLOAT_MAGIC, GEMM_FLOAT_MAGIC};

#define SDOT_GROUP(lane)                                   \
    "ldp    q20, q21, [%[pw]], #32\n"                      \
    "sdot   v0.4s, v20.16b, v16.4b[" #lane "]\n"           \
    "sdot   v1.4s, v21.16b, v16.4b[" #lane "]\n"           \
    "sdot   v2.4s, v20.16b, v17.4b[" #lane "]\n"           \
    "sdot   v3.4s, v21.16b, v17.4b[" #lane "]\n"           \
    "sdot   v4.4s, v20.16b, v18.4b[" #lane "]\n"           \
    "sdot   v5.4s, v21.16b, v18.4b[" #lane "]\n"           \
    "sdot   v6.4s, v20.16b, v19.4b[" #lane "]\n"           \
    "sdot   v7.4s, v21.16b, v19.4b[" #lane "]\n"
#define SCALE_ACC(acc, f, wd, lane, t, u)                  \
    "fsub   " #t ".4s, " #acc ".4s, v24.4s\n"              \
    "fmul   " #u ".4s, " #wd ".4s, v28.s[" #lane "]\n"     \
    "fmla   " #f ".4s, " #t ".4s, " #u ".4s\n"

static void gemm_packed_tile_sdot(const int8_t *pw, int64_t nb, const int8_t *const x[4],
                                  const int8_t *const ax[4], const float *xdT, const int32_t *xinit, float *out)
{
    (void)ax;
    (void)xinit;   /* signed by signed: the accumulators start at the magic alone */
    const int8_t *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    __asm__ volatile(
        "movi   v8.4s, #0\n"
        "movi   v9.4s, #0\n"
        "movi   v10.4s, #0\n"
        "movi   v11.4s, #0\n"
        "movi   v12.4s, #0\n"
        "movi   v13.4s, #0\n"
        "movi   v14.4s, #0\n"
        "movi   v15.4s, #0\n"
        "ldr    q24, [%[mg]]\n"                   /* 12582912.0f in every lane */
        "1:\n"                                    /* one 32-block per iteration */
        "ldp    q0, q1, [%[mg]]\n"
        "ldp    q2, q3, [%[mg]]\n"
        "ldp    q4, q5, [%[mg]]\n"
        "ldp    q6, q7, [%[mg]]\n"
        "ldr    q16, [%[x0]], #16\n"
        "ldr    q17, [%[x1]], #16\n"
        "ldr    q18, [%[x2]], #16\n"
        "ldr    q19, [%[x3]], #16\n"
        SDOT_GROUP(0) SDOT_GROUP(1) SDOT_GROUP(2) SDOT_GROUP(3)
        "ldr    q16, [%[x0]], #16\n"
        "ldr    q17, [%[x1]], #16\n"
        "ldr    q18, [%[x2]], #16\n"
        "ldr    q19, [%[x3]], #16\n"
        SDOT_GROUP(0) SDOT_GROUP(1) SDOT_GROUP(2) SDOT_GROUP(3)
        "ldp    q26, q27, [%[pw]], #32\n"         /* wd of the 8 weight rows */
        "ldr    q28, [%[xd]], #16\n"              /* xd of the 4 activation rows */
        SCALE_ACC(v0, v8, v26, 0, v29, v30)
        SCALE_ACC(v1, v9, v27, 0, v31, v25)
        SCALE_ACC(v2, v10, v26, 1, v29, v30)
        SCALE_ACC(v3, v11, v27, 1, v31, v25)
        SCALE_ACC(v4, v12, v26, 2, v29, v30)
        SCALE_ACC(v5, v13, v27, 2, v31, v25)
        SCALE_ACC(v6, v14, v26, 3, v29, v30)
        SCALE_ACC(v7, v15, v27, 3, v31, v25)
        "subs   %[n], %[n], #1\n"
        "b.ne   1b\n"
        "stp    q8, q9, [%[out]]\n"
        "stp    q10, q11, [%[out], #32]\n"
        "stp    q12, q13, [%[out], #64]\n"
        "stp    q14, q15, [%[out], #96]\n"
        : [pw] "+r"(pw), [x0] "+r"(x0), [x1] "+r"(x1), [x2] "+r"(x2), [x3] "+r"(x3), [xd] "+r"(xdT),
          [n] "+r"(nb)
        : [mg] "r"(gemm_magic8), [out] "r"(out)
        : "memory", "cc", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12",
          "v13", "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v24", "v25", "v26", "v27", "v28",
          "v29", "v30", "v31");
}
#undef SDOT_GROUP
#undef SCALE_ACC

static const struct gemm_packed_variant gemm_packed_sdot = {"sdot", gemm_packed_tile_sdot, 0, 0};
static int gemm_packed_on = 1;   /* 0: the row route alone ("rows") */

static const struct gemm_packed_variant *gemm_packed_variant(void)
{
    return __atomic_load_n(&gemm_packed_on, __ATOMIC_RELAXED) ? &gemm_packed_sdot : NULL;
}
#define GEMM_PACKED 1

const char *kernel_gemm_variant(void)
{
    return gemm_packed_variant() != NULL ? "sdot" : "rows";
}

const char *kernel_gemm_variants(void)
{
    return "rows sdot";
}

int kernel_set_gemm_variant(const char *name)
{
    if (strcmp(name, "rows") != 0 && strcmp(name, "sdot") != 0)
        return -1;
    __atomic_store_n(&gemm_packed_on, strcmp(name, "sdot") == 0, __ATOMIC_RELAXED);
    return 0;
}
#endif

/* Weight panels that stay in L2 with the activation tile (gemm_driver.h; the A76 has 512 KB per
 * core). The Q4 tile subtracts the nibble offset in int8 before its dots: no use for xsum8. */
#define GEMM_PANEL_BYTES (128 * 1024)
#define GEMM_Q4_XSUM8 0
#include "../gemm_driver.h"

/* ---- elementwise ------------------------------------------------------- */

/* sum_i (x[i] - c)^2 over a row (rmsnorm: c = 0, and x - 0 is x; layer_norm: c = the mean). */
static float sum_sq_around(const float *xr, int64_t D, float c)
{
    const float32x4_t vc = vdupq_n_f32(c);
    float32x4_t s0 = vdupq_n_f32(0.0f), s1 = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        const float32x4_t a = vsubq_f32(vld1q_f32(xr + i), vc), b = vsubq_f32(vld1q_f32(xr + i + 4), vc);
        s0 = vfmaq_f32(s0, a, a);
        s1 = vfmaq_f32(s1, b, b);
    }
    float ss = vaddvq_f32(vaddq_f32(s0, s1));
    for (; i < D; i++)
        ss += (xr[i] - c) * (xr[i] - c);
    return ss;
}

void rmsnorm_simd(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *orow = out + m * D;
        const float ss = sum_sq_around(xr, D, 0.0f);
        int64_t i;
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (i = 0; i + 4 <= D; i += 4)
            vst1q_f32(orow + i, vmulq_f32(vmulq_n_f32(vld1q_f32(xr + i), r), vld1q_f32(w + i)));
        for (; i < D; i++)
            orow[i] = xr[i] * r * w[i];
    }
}

#define ROPE_CHUNK 64

void rope_simd(float *x, int64_t M, int64_t H, int64_t hd, const int32_t *pos, const float *inv_freq)
{
    const int64_t half = hd / 2;
    float c[ROPE_CHUNK], s[ROPE_CHUNK];
    for (int64_t m = 0; m < M; m++) {
        const float p = (float)pos[m];
        for (int64_t i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            const int64_t n = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            for (int64_t i = 0; i < n; i++) {   /* libm, as the portable path (see avx2.c) */
                const float a = p * inv_freq[i0 + i];
                c[i] = cosf(a);
                s[i] = sinf(a);
            }
            for (int64_t h = 0; h < H; h++) {
                float *xh = x + (m * H + h) * hd + i0;
                int64_t i = 0;
                for (; i + 4 <= n; i += 4) {
                    const float32x4_t x0 = vld1q_f32(xh + i), x1 = vld1q_f32(xh + i + half);
                    const float32x4_t vc = vld1q_f32(c + i), vs = vld1q_f32(s + i);
                    vst1q_f32(xh + i, vsubq_f32(vmulq_f32(x0, vc), vmulq_f32(x1, vs)));
                    vst1q_f32(xh + i + half, vaddq_f32(vmulq_f32(x1, vc), vmulq_f32(x0, vs)));
                }
                for (; i < n; i++) {
                    const float x0 = xh[i], x1 = xh[i + half];
                    xh[i] = x0 * c[i] - x1 * s[i];
                    xh[i + half] = x1 * c[i] + x0 * s[i];
                }
            }
        }
    }
}

void silu_mul_simd(const float *gate, const float *up, int64_t n, float *out)
{
    const float32x4_t one = vdupq_n_f32(1.0f);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t g = vld1q_f32(gate + i);
        const float32x4_t e = exp_f32x4(vnegq_f32(g));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(g, vaddq_f32(one, e)), vld1q_f32(up + i)));
    }
    for (; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* Two passes over the row, as avx2.c: its mean, then the squares around it. */
void layer_norm_simd(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                     float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *orow = out + m * D;
        float32x4_t s0 = vdupq_n_f32(0.0f), s1 = vdupq_n_f32(0.0f);
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
            s0 = vaddq_f32(s0, vld1q_f32(xr + i));
            s1 = vaddq_f32(s1, vld1q_f32(xr + i + 4));
        }
        float sum = vaddvq_f32(vaddq_f32(s0, s1));
        for (; i < D; i++)
            sum += xr[i];
        const float mean = sum / (float)D;
        const float32x4_t vmean = vdupq_n_f32(mean);
        const float r = 1.0f / sqrtf(sum_sq_around(xr, D, mean) / (float)D + eps);
        for (i = 0; i + 4 <= D; i += 4) {
            const float32x4_t nrm = vmulq_n_f32(vsubq_f32(vld1q_f32(xr + i), vmean), r);
            vst1q_f32(orow + i, vfmaq_f32(vld1q_f32(b + i), nrm, vld1q_f32(w + i)));
        }
        for (; i < D; i++)
            orow[i] = (xr[i] - mean) * r * w[i] + b[i];
    }
}

/* x raised to GELU_TANH_LOW first, as avx2.c (the result there is below 1e-37). */
void gelu_tanh_simd(const float *x, int64_t n, float *out)
{
    const float32x4_t one = vdupq_n_f32(1.0f), low = vdupq_n_f32(GELU_TANH_LOW);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vmaxq_f32(vld1q_f32(x + i), low);
        const float32x4_t z = vfmaq_f32(v, vmulq_n_f32(v, GELU_TANH_C3), vmulq_f32(v, v));
        const float32x4_t e = exp_f32x4(vmulq_n_f32(z, GELU_TANH_K));
        vst1q_f32(out + i, vdivq_f32(v, vaddq_f32(one, e)));
    }
    for (; i < n; i++)
        out[i] = gelu_tanh_one(x[i]);
}

#endif /* KERNELS_NEON */
