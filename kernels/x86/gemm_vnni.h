/* The vpdpbusd micro-kernels of the packed GEMM route and of the row route, each in its own file compiled for its ISA
 * (avx_vnni.c, avx512_vnni.c); avx2.c chooses among them at run time (gemm_pack.h has the contract). */
#ifndef APPLIANCE_GEMM_VNNI_H
#define APPLIANCE_GEMM_VNNI_H
#include <stdint.h>
#include "../gemm_rows.h"

void gemm_packed_tile_avxvnni(const int8_t *pw, int64_t nb, const int8_t *const x[4], const int8_t *const ax[4],
                              const float *xdT, const int32_t *xinit, float *out);
void gemm_packed_tile_avx512vnni(const int8_t *pw, int64_t nb, const int8_t *const x[4],
                                 const int8_t *const ax[4], const float *xdT, const int32_t *xinit, float *out);

/* The row route's tile runs (gemm_rows.h) with vpdpbusd, from the same files. */
void gemm_rows_run_avxvnni(const struct gemm_rows_args *a);
void gemm_rows_run_avx512vnni(const struct gemm_rows_args *a);

/* The strips layout's micro-kernels (gemm_strips.h): a whole 16-row strip a tile on AVX512-VNNI's
 * 16 lanes, half a strip a tile on AVX2's 8 (x86/avx2_strips.c, maddubs). */
#include "../gemm_strips.h"
void gemm_strips_run_avx512vnni(const struct gemm_strips_args *a);
void gemm_strips_run_avx2(const struct gemm_strips_args *a);

#endif
