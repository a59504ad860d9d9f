/* KV cache writes (kernels.h, "KV cache writes"): plain C, one token per layer in decode; the q8
 * write's vector twin is in x86/avx2.c and arm/neon.c. */
#include "internal.h"

void kv_store_q8_portable(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                          int8_t *dst, float *scale)
{
    kv_store_q8_rows(x, T, n_kv, hd, slot, bs, dst, scale, quantize_group_q8);
}

void kv_store_q4(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                 uint8_t *dst, float *scale)
{
    const int64_t nb = hd / QK;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < n_kv; h++) {
            const float *src = x + (t * n_kv + h) * hd;
            const int64_t row = kv_cache_row(slot[t], h, n_kv, bs);
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = src + b * QK;
                float vmax = 0.0f, amax = 0.0f;   /* the signed value of largest magnitude, first wins */
                for (int i = 0; i < QK; i++) {
                    if (fabsf(xb[i]) > amax) {
                        amax = fabsf(xb[i]);
                        vmax = xb[i];
                    }
                }
                const float d = vmax / -8.0f;
                const float inv = d != 0.0f ? 1.0f / d : 0.0f;
                uint8_t *q = dst + row * hd / 2 + b * QK / 2;
                for (int i = 0; i < QK / 2; i++) {
                    float lo = floorf(xb[i] * inv + 8.5f), hi = floorf(xb[i + QK / 2] * inv + 8.5f);
                    lo = lo < 0.0f ? 0.0f : lo > 15.0f ? 15.0f : lo;
                    hi = hi < 0.0f ? 0.0f : hi > 15.0f ? 15.0f : hi;
                    q[i] = (uint8_t)((uint8_t)lo | ((uint8_t)hi << 4));
                }
                scale[row * nb + b] = d;
            }
        }
    }
}

void kv_store_f32(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                  float *dst)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < n_kv; h++)
            memcpy(dst + kv_cache_row(slot[t], h, n_kv, bs) * hd, x + (t * n_kv + h) * hd,
                   (size_t)hd * sizeof(float));
}
