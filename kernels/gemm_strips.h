/*
 * Weights stored pre-interleaved for an unsigned-by-signed dot (vpdpbusd), once, at load: the
 * "strips" layout of kernels.h's gemm_strips_* (strips.c packs and drives it; x86/avx512_vnni.c
 * and x86/avx2_strips.c have the micro-kernels).
 *
 * Why: the row route (gemm_rows.h) reads Q8_0/Q4_0 rows as stored and transposes every block of
 * 8 or 16 rows in registers (24 shuffles a block, 16 scalar scale loads) before a single dot; at a
 * decode batch of 8 rows that arithmetic, not the weight reads, bounds it (docs/performance.md).
 * Stored once in the order the dot wants, a block is 8 aligned loads and 8 dots per activation
 * row, and a strip's weights are one sequential stream instead of 16 row streams.
 *
 * A strip is STRIP_ROWS = 16 weight rows (n0 = 16 s ..), STRIPS_BYTES(is_q4, K) bytes at
 * ws + s * STRIPS_BYTES: per 32-block b of K, the block's weights (STRIP_BLOCK_BYTES), then after
 * all nb blocks the rows' fp16 scales, [nb][16]. Rows past N are zero with scale 0.
 *   q8: 8 vectors of 64 bytes, vector g lane r = row r's elements 4g .. 4g+3, each as w ^ 0x80
 *       (the unsigned w + 128; the 128 * sum(x) that adds leaves through the lanes' start);
 *   q4: 4 vectors of 64 bytes, vector j lane r = row r's stored bytes 4j .. 4j+3 unchanged: their
 *       low nibbles are elements 4j .. 4j+3 and their high nibbles 4j+16 .. 4j+19 (kernels.h), so
 *       one AND and one shift give groups j and j + 4 as unsigned w + 8, and the lanes start 8 *
 *       sum(x) lower.
 * The block dot d is exact, and the float operations per output are the other routes' (d, then
 * wd * xd, one fused multiply-add per block): gemm_strips gives gemm_q8_simd's bits.
 */
#ifndef APPLIANCE_GEMM_STRIPS_H
#define APPLIANCE_GEMM_STRIPS_H
#include <stdint.h>

#define STRIP_ROWS 16
#define STRIP_BLOCK_BYTES(is_q4) ((is_q4) ? 256 : 512)
/* one strip, rounded up to whole cache lines so every strip starts aligned */
#define STRIPS_BYTES(is_q4, K) \
    ((((int64_t)(K) / QK) * (STRIP_BLOCK_BYTES(is_q4) + 2 * STRIP_ROWS) + 63) / 64 * 64)

/* The first tile of a strip's rows streams its weights from memory; the micro-kernels ask for them
 * this far ahead into L2, so that the dots of a batch overlap the stream (the hardware prefetcher
 * alone runs too close behind at 8 rows). Zen 4, AVX512-VNNI, 150 distinct q8 matrices a pass
 * (500 MB), 2 threads, three alternated rounds: 8 rows of 1024 x 3072 21.0-21.9 ms against
 * 28.7-32.2 without, 3072 x 1024 22.7-29.3 against 36.1-40.8; one row unchanged; 16 KB ahead no
 * better. Zen 3, AVX2: a batch-8 decode step of the Qwen3-0.6B shape 83.5 ms (two rounds) against
 * 94.3 without and 101-109 at 4 KB. */
#define STRIPS_PREFETCH_BYTES 8192

/* A run of the micro-kernel: activation rows 0 .. mr-1 of x against strips s0 .. s1-1. */
struct gemm_strips_args {
    int is_q4, mr;
    const uint8_t *ws;          /* the strips (64-byte aligned) */
    int64_t N, K, nb, strip_bytes;
    int64_t s0, s1;
    const int8_t *x;            /* mr x K */
    const float *xd;            /* mr x nb: the activation rows' block scales */
    const int32_t *xinit;       /* mr x nb: GEMM_FLOAT_MAGIC - (128 or 8) * the block's sum of x */
    float *y;                   /* y[m * ldy + n], n the weight row */
    int64_t ldy;
};

typedef void (*gemm_strips_fn)(const struct gemm_strips_args *a);

/* A micro-kernel's run of activation rows t0 .. t0+MR_-1 with (is_q4, MR_) as constants, so that
 * its tile loops unroll: one case of the switch over the rows left (`tiles(a, is_q4, mr, t0)`). */
#define STRIPS_TILES_CASE(tiles, a, MR_, t0) \
    case MR_: if ((a)->is_q4) tiles(a, 1, MR_, t0); else tiles(a, 0, MR_, t0); break;

#endif
