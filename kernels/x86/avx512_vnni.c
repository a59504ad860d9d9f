/*
 * The packed GEMM route's micro-kernel (256-bit registers) and the row route's tile run (512-bit
 * registers, 16-row strips) with AVX512-VNNI (EVEX vpdpbusd: Cascade Lake, Ice Lake, Zen 4, which
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
#endif
