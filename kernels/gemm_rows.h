/*
 * The row route's tile runs (gemm_driver.h) taken over by a micro-kernel of another ISA: on x86 the
 * vpdpbusd kernels (x86/gemm_rows_x86.h), which decode-sized products (M < GEMM_PACK_MIN_ROWS) run
 * on CPUs with VNNI. A run is mr activation rows (a chunk's, from a row that is a multiple of 4)
 * against the weight rows of the groups g0 .. g1 (4 rows a group), in their stored layout; it computes what the packed route's
 * tile (gemm_pack.h, xor_mask 0x80) computes for them: the same exact int32 block dots and float
 * operations in the same order, so the bits of gemm_tile and of prefill.
 */
#ifndef APPLIANCE_GEMM_ROWS_H
#define APPLIANCE_GEMM_ROWS_H
#include <stdint.h>

struct gemm_rows_args {
    int is_q4, mr;
    const uint8_t *wq;          /* the weights: N rows of row_bytes */
    const uint16_t *wd;         /* their fp16 block scales, N x nb */
    int64_t N, nb, row_bytes;
    int64_t g0, g1;             /* groups of 4 weight rows, g1 exclusive */
    const int8_t *x;            /* the run's activation rows, mr x K */
    int64_t K;
    const float *xdT;           /* the rows' block scales and lane starts, as gemm_packed_prepare makes */
    const int32_t *xinit;       /* them for xor_mask 0x80 (groups of 4 rows, from the run's first) */
    float *y;                   /* y[m * ldy + n]: the run's first row, column 0 */
    int64_t ldy;
    int prefetch;               /* 1: fetch each next strip's rows while the first rows meet this one */
};

typedef void (*gemm_rows_fn)(const struct gemm_rows_args *a);

#endif
