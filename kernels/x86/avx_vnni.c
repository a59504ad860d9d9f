/*
 * The packed GEMM route's micro-kernel with AVX-VNNI (VEX-encoded vpdpbusd on ymm: Alder Lake and
 * later, Sapphire Rapids, Zen 5), the one file built for that ISA. Its code is x86/gemm_packed_x86.h,
 * which the AVX2 build also runs with vpdpbusd emulated (the tests' "avx2-vnni-emulated"), and a CPU
 * runs it only after it gave the AVX2 kernel's bits on a known case (avx2.c, variant_agrees).
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#pragma GCC target("avxvnni")
#include <immintrin.h>
#include "../gemm_pack.h"
#include "gemm_vnni.h"

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
#endif
