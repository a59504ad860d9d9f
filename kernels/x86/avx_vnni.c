/*
 * The packed GEMM route's micro-kernel and the row route's tile run with AVX-VNNI (VEX-encoded
 * vpdpbusd on ymm: Alder Lake and later, Sapphire Rapids, Zen 5), the one file built for that ISA.
 * Their code is x86/gemm_packed_x86.h and x86/gemm_rows_x86.h, which the AVX2 build also runs with
 * vpdpbusd emulated (the tests' "avx2-vnni-emulated"), and a CPU runs them only after they gave the
 * AVX2 kernels' bits on a known case (avx2.c, variant_agrees).
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#pragma GCC target("avxvnni")
#include <immintrin.h>
#include "../gemm_pack.h"
#include "gemm_vnni.h"
#include "../gemm_rows.h"
#include "avx2_common.h"

#define PACKED_TILE tile_avxvnni
#define PACKED_DOT(acc, w, xb, axb) _mm256_dpbusd_avx_epi32(acc, w, xb)
#define PACKED_WANTS_ABS 0
#define PACKED_XINIT 1
#include "gemm_packed_x86.h"

void gemm_packed_tile_avxvnni(const int8_t *pw, int64_t nb, const int8_t *const x[4], const int8_t *const ax[4],
                              const float *xdT, const int32_t *xinit, float *out)
{
    tile_avxvnni(pw, nb, x, ax, xdT, xinit, out);
}

#define ROWS_RUN rows_avxvnni
#define ROWS_DOT(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define ROWS_MR 4
#include "gemm_rows_x86.h"

void gemm_rows_run_avxvnni(const struct gemm_rows_args *a)
{
    rows_avxvnni(a);
}
#endif
