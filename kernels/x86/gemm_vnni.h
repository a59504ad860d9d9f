/* The packed GEMM route's vpdpbusd micro-kernels, each in its own file compiled for its ISA
 * (avx_vnni.c, avx512_vnni.c); avx2.c chooses among them at run time (gemm_pack.h has the contract). */
#ifndef APPLIANCE_GEMM_VNNI_H
#define APPLIANCE_GEMM_VNNI_H
#include <stdint.h>

void gemm_packed_tile_avxvnni(const int8_t *pw, int64_t nb, const int8_t *const x[4], const int8_t *const ax[4],
                              const float *xdT, const int32_t *xinit, float *out);
void gemm_packed_tile_avx512vnni(const int8_t *pw, int64_t nb, const int8_t *const x[4],
                                 const int8_t *const ax[4], const float *xdT, const int32_t *xinit, float *out);

#endif
