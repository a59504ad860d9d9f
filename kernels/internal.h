/* Helpers shared by the path files; not part of the contract (kernels.h is). */
#ifndef APPLIANCE_KERNELS_INTERNAL_H
#define APPLIANCE_KERNELS_INTERNAL_H
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "kernels.h"
#include "fallback.h"

/* Below this many multiply-adds a GEMM runs on the calling thread: waking the
 * OpenMP team costs a few microseconds, more than such a product takes. */
#define KERNELS_PARALLEL_MIN_MACS (1 << 18)

static inline int kernels_threads(int nthreads)
{
    return nthreads > 0 ? nthreads : omp_get_max_threads();
}

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Exact: every half is a float. Bit manipulation so the portable path needs no F16C/fp16 hardware. */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        const float sub = (float)mant * 0x1p-24f;   /* zero or subnormal: mant * 2^-24, exact */
        return sign ? -sub : sub;
    }
    if (exp == 31)
        return f32_from_bits(sign | 0x7f800000u | (mant << 13));
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

#endif
