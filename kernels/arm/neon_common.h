/* AArch64 NEON building blocks shared by arm/neon.c and arm/neon_attention.c.
 * With dotprod (ARMv8.2 sdot, the RK3588's A76 and A55) int8 dots are vdotq_s32;
 * without it the same sums come from vmull_s8 + vpadalq_s16 (path "neon"). */
#ifndef APPLIANCE_NEON_COMMON_H
#define APPLIANCE_NEON_COMMON_H
#include <arm_neon.h>
#include "../internal.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* acc + the 16 products a[i]*b[i], spread over the 4 lanes (only the lane total is defined). */
ALWAYS_INLINE int32x4_t dot_s8x16(int32x4_t acc, int8x16_t a, int8x16_t b)
{
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));   /* |127*127| fits int16 */
    const int16x8_t hi = vmull_high_s8(a, b);
    return vpadalq_s16(vpadalq_s16(acc, lo), hi);
#endif
}

/* One 32-block dot as int32x4 partial sums. */
ALWAYS_INLINE int32x4_t dot_block(const int8_t *a, const int8_t *b)
{
    const int32x4_t acc = dot_s8x16(vdupq_n_s32(0), vld1q_s8(a), vld1q_s8(b));
    return dot_s8x16(acc, vld1q_s8(a + 16), vld1q_s8(b + 16));
}

/* Four partial-sum vectors -> {sum a, sum b, sum c, sum d}: exact int32 block dots. */
ALWAYS_INLINE int32x4_t reduce4_block_s32(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d)
{
    return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}

/* Four float vectors -> their four horizontal sums, in order. */
ALWAYS_INLINE float32x4_t hsum4x4_f32(float32x4_t a, float32x4_t b, float32x4_t c, float32x4_t d)
{
    return vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d));
}

/* 16 bytes of Q4_0 nibbles -> elements 0..15 (lo) and 16..31 (hi) as int8 in [-8, 7]. */
ALWAYS_INLINE void unpack_q4_block(const uint8_t *p, int8x16_t *lo, int8x16_t *hi)
{
    const uint8x16_t raw = vld1q_u8(p);
    const int8x16_t eight = vdupq_n_s8(8);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f))), eight);
    *hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
}

/* Four IEEE halves (maybe from four rows) -> float32x4. */
ALWAYS_INLINE float32x4_t halves4(uint16_t a, uint16_t b, uint16_t c, uint16_t d)
{
    uint16x4_t h = vdup_n_u16(a);
    h = vset_lane_u16(b, h, 1);
    h = vset_lane_u16(c, h, 2);
    h = vset_lane_u16(d, h, 3);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* exp(x), the same Cephes polynomial and clamps as the AVX2 path (see x86/avx2_common.h). */
ALWAYS_INLINE float32x4_t exp_f32x4(float32x4_t x)
{
    x = vminq_f32(x, vdupq_n_f32(88.0f));            /* vminq/vmaxq propagate NaN */
    x = vmaxq_f32(x, vdupq_n_f32(-87.33654f));
    const float32x4_t fx = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, fx, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, r);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, r);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, r);
    y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), y, vmulq_f32(r, r));
    const int32x4_t n = vcvtnq_s32_f32(fx);
    const float32x4_t pow2n = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23));
    return vmulq_f32(y, pow2n);
}

#endif
