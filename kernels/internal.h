/* Helpers shared by the path files; not part of the contract (kernels.h is). */
#ifndef APPLIANCE_KERNELS_INTERNAL_H
#define APPLIANCE_KERNELS_INTERNAL_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kernels.h"
#include "fallback.h"
#include "pool.h"

/* Below this many multiply-adds a GEMM runs on the calling thread: waking the pool's workers
 * costs a few microseconds, more than such a product takes. */
#define KERNELS_PARALLEL_MIN_MACS (1 << 18)

static inline int kernels_threads(int nthreads)
{
    return nthreads > 0 ? nthreads : kernel_default_threads();
}

/* Where each family's last team size is kept (dispatch.c; kernel_last_threads reads it). */
extern int kernels_threads_ran[KERNEL_FAMILIES];

/* The team size a family's job got (pool_run records it: 1 when the work ran on the caller). */
static inline void kernels_note_team(int family, int team)
{
    if (family >= 0 && family < KERNEL_FAMILIES)
        __atomic_store_n(&kernels_threads_ran[family], team, __ATOMIC_RELAXED);
}

/* The cache row of the token at `slot` (block * bs + offset), kv head h: ((block * n_kv + h) * bs +
 * offset) in kernels.h's [nblk, n_kv, bs, ...] layouts (the KV writes, portable and vector). */
static inline int64_t kv_cache_row(int32_t slot, int64_t h, int64_t n_kv, int64_t bs)
{
    const int64_t block = slot / bs, offset = slot % bs;
    return (block * n_kv + h) * bs + offset;
}

/* int8 max-abs quantization of one group of n floats; returns its scale d = amax/127, and
 * q = rint(x * 127/amax). Both in float32 as numpy computes them (appliance.kernels.quant), so
 * the results agree bit for bit. A group is a 32-block of an activation row (quantize_rows_q8)
 * or a whole (token, kv head) row of the q8 cache (kv_store_q8_portable). */
static inline float quantize_group_q8(const float *x, int64_t n, int8_t *q)
{
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < n; i++)
        q[i] = (int8_t)lrintf(x[i] * inv);
    return amax / 127.0f;
}

/* A q8 KV write (kernels.h kv_store_q8_*): every (token, kv head) row of x float[T, n_kv, hd]
 * quantized by `row` (quantize_group_q8 or a vector twin: q int8[hd] and the scale it returns)
 * into its cache row. Inlined with a constant `row`, so the call is direct. */
static inline __attribute__((always_inline)) void kv_store_q8_rows(
    const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs, int8_t *dst,
    float *scale, float (*row)(const float *x, int64_t n, int8_t *q))
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < n_kv; h++) {
            const int64_t r = kv_cache_row(slot[t], h, n_kv, bs);
            scale[r] = row(x + (t * n_kv + h) * hd, hd, dst + r * hd);
        }
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

/* GELU, tanh form, as x / (1 + exp(-2z)) (kernels.h gelu_tanh): the factor -2 sqrt(2/pi), and the
 * input below which the result is under 1e-37 and x is raised to it (vector exps clamp their
 * argument, so a huge negative x would not vanish). One element, for the paths' scalar tails. */
#define GELU_TANH_K (-1.5957691216057308f)
#define GELU_TANH_C3 0.044715f       /* z's cubic coefficient */
#define GELU_TANH_LOW (-20.0f)

static inline float gelu_tanh_one(float x)
{
    const float v = x > GELU_TANH_LOW ? x : GELU_TANH_LOW;
    return v / (1.0f + expf(GELU_TANH_K * (v + GELU_TANH_C3 * v * v * v)));
}

#endif
