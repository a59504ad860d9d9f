/*
 * The packed route of the SIMD GEMM (gemm_driver.h): weights repacked per chunk so that one vector
 * of int32 lanes accumulates eight (NEON: two times four) output features at once, with no
 * horizontal sum per block. Packing costs about one byte copy per weight byte, paid once per run of
 * GEMM_PACK_ROWS activation rows, which then do 4 * GEMM_PACK_ROWS multiply-adds per weight byte.
 *
 * A strip is GEMM_STRIP = 8 weight rows (output features n0 .. n0+7). Per 32-block b of K it holds
 *   int8  w[8 groups][8 rows][4]   group g = elements 4g .. 4g+3 of the block, row by row
 *   float wd[8]                    the rows' block scales (0 past the last row)
 * GEMM_STRIP_BLOCK_BYTES in all; rows past N are zero. With xor_mask 0x80 every weight byte is
 * stored as w ^ 0x80, the unsigned w + 128 an unsigned-by-signed dot (vpdpbusd) multiplies; the
 * 128 * sum(x) it adds comes back out through the accumulators' start value (xinit).
 *
 * The block dot d (|d| <= 32 * 127 * 127 < 2^22) is turned into a float without a conversion
 * instruction: an int32 lane that starts at GEMM_FLOAT_MAGIC (the bits of 1.5 * 2^23) and gets d
 * added holds the bits of the float 1.5 * 2^23 + d, so one subtraction of 1.5 * 2^23 gives d exactly.
 */
#ifndef APPLIANCE_GEMM_PACK_H
#define APPLIANCE_GEMM_PACK_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GEMM_STRIP 8
#define GEMM_STRIP_BLOCK_BYTES (GEMM_STRIP * QK + GEMM_STRIP * 4)
#define GEMM_FLOAT_MAGIC 0x4B400000      /* bits of 12582912.0f = 1.5 * 2^23 */
#define GEMM_FLOAT_MAGIC_F 12582912.0f
#ifndef GEMM_PACK_MIN_ROWS
#define GEMM_PACK_MIN_ROWS 32             /* below this a packed panel serves too few rows to pay */
#endif
#ifndef GEMM_PACK_ROWS
#define GEMM_PACK_ROWS 128                /* activation rows of one chunk (a multiple of 4) */
#endif

/* A micro-kernel of the packed route:
 *   tile(pw, nb, x[4], ax[4], xdT, xinit, out): for the strip pw (nb blocks) and 4 activation rows
 *   x[m] (int8, K = nb * 32; ax[m] = |x[m]| when wants_abs), out[m * 8 + c] =
 *   sum_b fma-accumulated float(d[m, c, b]) * (wd[c, b] * xdT[b * 4 + m]), d the exact block dot;
 *   xinit int32[nb * 4] (NULL: GEMM_FLOAT_MAGIC for every lane) the start of block b's lanes of row m. */
typedef void (*gemm_packed_tile_fn)(const int8_t *pw, int64_t nb, const int8_t *const x[4],
                                    const int8_t *const ax[4], const float *xdT, const int32_t *xinit,
                                    float *out);

struct gemm_packed_variant {
    const char *name;
    gemm_packed_tile_fn tile;
    uint8_t xor_mask;    /* 0, or 0x80 for an unsigned-by-signed dot */
    int wants_abs;       /* the tile reads |x| */
};

/* Per call, made before the job: what every tile of the call reads besides x and the strips. */
struct gemm_packed_operands {
    float *xdT;          /* [ceil(M/4)][nb][4]: xd of each 4-row group, block-major (0 past M) */
    int32_t *xinit;      /* same layout: GEMM_FLOAT_MAGIC - xor_mask * sum of the block's x, or NULL */
    int8_t *xabs;        /* [M][K] |x|, or NULL */
};

/* Strip n0 .. n0+7 of Q8_0 (is_q4 0) or Q4_0 weights, packed into dst (nb * GEMM_STRIP_BLOCK_BYTES). */
static inline void gemm_pack_strip(int is_q4, const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                                   int64_t n0, uint8_t xor_mask, int8_t *dst)
{
    const int64_t nb = K / QK, row_bytes = is_q4 ? K / 2 : K;
    for (int64_t b = 0; b < nb; b++, dst += GEMM_STRIP_BLOCK_BYTES) {
        float *wdf = (float *)(dst + GEMM_STRIP * QK);
        for (int c = 0; c < GEMM_STRIP; c++) {
            const int64_t n = n0 + c;
            int8_t blk[QK];
            if (n < N) {
                const uint8_t *src = wq + n * row_bytes;
                if (is_q4) {
                    for (int i = 0; i < QK / 2; i++) {
                        const uint8_t byte = src[b * (QK / 2) + i];
                        blk[i] = (int8_t)((byte & 0x0f) - 8);
                        blk[i + QK / 2] = (int8_t)((byte >> 4) - 8);
                    }
                } else {
                    memcpy(blk, src + b * QK, QK);
                }
                wdf[c] = half_to_float(wd[n * nb + b]);
            } else {
                memset(blk, 0, QK);
                wdf[c] = 0.0f;
            }
            for (int g = 0; g < QK / 4; g++)
                for (int i = 0; i < 4; i++)
                    dst[g * (GEMM_STRIP * 4) + c * 4 + i] = (int8_t)((uint8_t)blk[g * 4 + i] ^ xor_mask);
        }
    }
}

static inline void gemm_packed_release(struct gemm_packed_operands *pk)
{
    free(pk->xdT);
    free(pk->xinit);
    free(pk->xabs);
}

/* The sum of one activation block (QK int8 values): the offset terms of the q4 tile (xsum8) and of
 * the xor-biased dots (xinit) are multiples of it. */
static inline int32_t gemm_block_sum(const int8_t *x)
{
    int32_t sum = 0;
    for (int k = 0; k < QK; k++)
        sum += x[k];
    return sum;
}

/* Entries of xdT (and of xinit): M rows in groups of 4, nb blocks each. */
static inline int64_t gemm_packed_row_entries(int64_t M, int64_t nb)
{
    return ((M + 3) / 4) * nb * 4;
}

/* The call's operands for variant v; 0 when out of memory (nothing left allocated). */
static inline int gemm_packed_prepare(struct gemm_packed_operands *pk, const struct gemm_packed_variant *v,
                                      const int8_t *xq, const float *xd, int64_t M, int64_t K)
{
    const int64_t nb = K / QK, groups = (M + 3) / 4, entries = gemm_packed_row_entries(M, nb);
    pk->xdT = malloc((size_t)entries * sizeof(float));
    pk->xinit = v->xor_mask ? malloc((size_t)entries * sizeof(int32_t)) : NULL;
    pk->xabs = v->wants_abs ? malloc((size_t)(M * K)) : NULL;
    if (pk->xdT == NULL || (v->xor_mask && pk->xinit == NULL) || (v->wants_abs && pk->xabs == NULL)) {
        gemm_packed_release(pk);
        memset(pk, 0, sizeof *pk);
        return 0;
    }
    for (int64_t t = 0; t < groups; t++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t i = 0; i < 4; i++) {
                const int64_t m = 4 * t + i;
                pk->xdT[(t * nb + b) * 4 + i] = m < M ? xd[m * nb + b] : 0.0f;
                if (pk->xinit != NULL) {
                    const int32_t sum = m < M ? gemm_block_sum(xq + m * K + b * QK) : 0;
                    pk->xinit[(t * nb + b) * 4 + i] = GEMM_FLOAT_MAGIC - (int32_t)v->xor_mask * sum;
                }
            }
    if (pk->xabs != NULL)
        for (int64_t i = 0; i < M * K; i++)
            pk->xabs[i] = (int8_t)(xq[i] < 0 ? -xq[i] : xq[i]);
    return 1;
}

#endif
