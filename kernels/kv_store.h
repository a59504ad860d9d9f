/*
 * Writing K/V rows into the paged cache (layouts of kernels.h), quantizing on the way.
 * Memory-bound and small (one token per layer in decode), so plain C compiled with the
 * build's arch flags; appliance.quant.quantize_kv_q8/_q4 are the reference it equals bit for bit.
 *
 * x float[T, n_kv, hd]; slot[t] = physical_block * bs + offset of token t.
 *   q8 : dst int8[nblk, n_kv, bs, hd],  scale float[nblk, n_kv, bs]       d = amax/127, q = rint(x*127/amax)
 *   q4 : dst uint8[nblk, n_kv, bs, hd/2], scale float[nblk, n_kv, bs, hd/32]  Q4_0 (llama.cpp rule)
 *   f32: dst float[nblk, n_kv, bs, hd]
 */
#ifndef APPLIANCE_KV_STORE_H
#define APPLIANCE_KV_STORE_H
#include <stdint.h>

void kv_store_q8(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                 int8_t *dst, float *scale);
void kv_store_q4(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                 uint8_t *dst, float *scale);
void kv_store_f32(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                  float *dst);

#endif
